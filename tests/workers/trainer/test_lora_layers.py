"""Layers that read one input share one autograd node, only when they really get that input."""

from __future__ import annotations

import torch
from torch import nn

from contract.configs import LoraConfig
from workers.trainer.adapters import Adapter
from workers.trainer.lora_layers import Router, RoutingPlan, wrap_linear_layers


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = nn.Linear(8, 8), nn.Linear(8, 4), nn.Linear(8, 4)
        self.o_proj = nn.Linear(8, 8)


def _wrapped():
    torch.manual_seed(0)
    model = Attention().requires_grad_(False)
    router = Router()
    base_layers = wrap_linear_layers(model, router)
    adapter = Adapter.create("a", LoraConfig(rank=2, train_mlp=False, train_unembed=False), base_layers, torch.float32)
    with torch.no_grad():
        for w in adapter.weights.values():
            w.lora_b.normal_()
    return model, router, adapter


def test_shared_input_layers_form_a_group():
    model, _, _ = _wrapped()
    assert model.q_proj.group is model.k_proj.group is model.v_proj.group
    assert [model.q_proj.member, model.k_proj.member, model.v_proj.member] == [0, 1, 2]
    assert model.o_proj.group.paths == ["o_proj"]


def test_group_node_only_for_the_same_input():
    model, router, adapter = _wrapped()
    router.plan = RoutingPlan([(adapter, 0, 5)])
    x = torch.randn(5, 8, requires_grad=True)
    q, k = model.q_proj(x), model.k_proj(x)
    assert q.grad_fn is k.grad_fn  # computed together
    other = x * 1  # equal values, another tensor: computed on its own
    v_other = model.v_proj(other)
    assert v_other.grad_fn is not q.grad_fn

    router.plan = RoutingPlan([(adapter, 0, 5)])  # a new pass forgets what the last one computed
    assert model.v_proj(x).grad_fn is not q.grad_fn

    w = adapter.weights["v_proj"]
    expected = model.v_proj.base(x) + adapter.scale * (x @ w.lora_a.t()) @ w.lora_b.t()
    torch.testing.assert_close(v_other, expected)
    router.plan = None
    torch.testing.assert_close(model.q_proj(x), model.q_proj.base(x))  # no plan: the base layer


def test_an_input_changed_in_place_is_not_reused():
    model, router, adapter = _wrapped()
    router.plan = RoutingPlan([(adapter, 0, 5)])
    x = torch.randn(5, 8)
    q = model.q_proj(x)
    x.mul_(2)
    k = model.k_proj(x)
    assert k.grad_fn is not q.grad_fn
    w = adapter.weights["k_proj"]
    torch.testing.assert_close(k, model.k_proj.base(x) + adapter.scale * (x @ w.lora_a.t()) @ w.lora_b.t())

"""A pass that stacks its adapters (workers/trainer/stacked_adapters.py) gives each adapter what it
gets alone; the peft parity of every loss on this path is in test_engine_parity.py ("one-layout")."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from contract.configs import LoraConfig
from contract.inputs import ForwardBackwardInput
from models.registry import resolve_model
from tests.workers.trainer.peft_reference import random_datum, rel_err
from tests.workers.trainer.test_engine_parity import spy_on_stacked_passes
from workers.trainer.engine import TrainerEngine
from workers.trainer.stacked_adapters import StackedAdapters


def one_layout_engine(model, n_adapters: int) -> TrainerEngine:
    engine = TrainerEngine(model)
    gen = torch.Generator().manual_seed(11)
    for i in range(n_adapters):
        adapter = engine.create_adapter(f"t{i}", LoraConfig(rank=8, alpha=4.0 * (i + 1), seed=i))
        with torch.no_grad():  # B starts at zero; make every gradient non-trivial
            for w in adapter.weights.values():
                w.lora_b.copy_(0.05 * torch.randn(w.lora_b.shape, generator=gen))
    return engine


def requests(engine, lengths: list[int], seed: int) -> list[ForwardBackwardInput]:
    gen = torch.Generator().manual_seed(seed)
    return [ForwardBackwardInput(f"t{i}", [random_datum("importance_sampling", n, gen, engine.vocab_size)],
                                 "importance_sampling") for i, n in enumerate(lengths)]


def grads_of(engine, adapter_id) -> torch.Tensor:
    return engine.adapter(adapter_id).flat_grads.clone()


def check_each_alone(engine, batch: list[ForwardBackwardInput], calls: int = 1) -> None:
    """Run `batch` `calls` times (gradients accumulate), then each request alone as often, and compare."""
    for _ in range(calls):
        together = engine.forward_backward(batch)
    together_grads = {r.adapter_id: grads_of(engine, r.adapter_id) for r in batch}
    for r in batch:
        engine.adapter(r.adapter_id).zero_grad()
    for request, out in zip(batch, together):
        for _ in range(calls):
            alone = engine.forward_backward([request])[0]
        torch.testing.assert_close(out.loss_fn_outputs[0]["logprobs"], alone.loss_fn_outputs[0]["logprobs"],
                                   rtol=1e-6, atol=1e-6)
        # a sum over up to 16 tokens of advantage-weighted ratios of logprobs that agree within
        # 1e-6, with cancellation: an absolute bound (a Zen 5 differed by 2.8e-6 on a sum of -0.67)
        assert out.metrics["loss:sum"] == pytest.approx(alone.metrics["loss:sum"], rel=1e-6, abs=1e-5)
        assert rel_err(together_grads[request.adapter_id], grads_of(engine, request.adapter_id)) <= 1e-5


@pytest.mark.parametrize("lengths", [[16, 16, 16, 16], [5, 12, 9, 7]], ids=["equal (a view)", "unequal (a gather)"])
def test_stacked_pass_gives_each_adapter_its_own_result(lengths, tiny_model_path, monkeypatch):
    stacked_passes = spy_on_stacked_passes(monkeypatch)
    engine = one_layout_engine(tiny_model_path, len(lengths))
    check_each_alone(engine, requests(engine, lengths, seed=3), calls=2)
    assert stacked_passes[:2] == [True, True] and not any(stacked_passes[2:])  # alone: nothing to stack


def test_forward_only_stacked_pass_writes_no_gradients(tiny_model_path, monkeypatch):
    stacked_passes = spy_on_stacked_passes(monkeypatch)
    engine = one_layout_engine(tiny_model_path, 3)
    batch = requests(engine, [6, 6, 6], seed=4)
    together = engine.forward(batch)
    assert stacked_passes == [True]
    for i, (request, out) in enumerate(zip(batch, together)):
        assert not engine.adapter(f"t{i}").has_gradients() and not grads_of(engine, f"t{i}").any()
        alone = engine.forward([request])[0]
        torch.testing.assert_close(out.loss_fn_outputs[0]["logprobs"], alone.loss_fn_outputs[0]["logprobs"])


@pytest.fixture(scope="module")
def smollm2_first_layers(tmp_path_factory) -> Path:
    """SmolLM2-135M cut to its first 2 of 30 layers: every module and shape of the whole model (the
    49,152-token head among them) at a fifteenth of its layers (23 s of the fast subset on all 30)."""
    folder = tmp_path_factory.mktemp("smollm2-2-layers")
    AutoModelForCausalLM.from_pretrained(resolve_model("SmolLM2-135M-Instruct"), num_hidden_layers=2).save_pretrained(folder)
    return folder


def test_smollm2_stacks_all_but_the_vocabulary_wide_head(smollm2_first_layers, monkeypatch):
    """lm_head (49,152 outputs) keeps the segment loop, which adds into each adapter's gradient
    itself; every other layer is stacked."""
    stacked_passes = spy_on_stacked_passes(monkeypatch)
    engine = one_layout_engine(smollm2_first_layers, 2)
    first = engine.adapter("t0")
    bank = StackedAdapters.for_pass([(first, 0, 4), (engine.adapter("t1"), 4, 8)], 8, True, engine.device)
    assert "lm_head" not in bank.paths and len(bank.paths) == len(first.weights) - 1
    check_each_alone(engine, requests(engine, [4, 7], seed=5))
    assert stacked_passes[0]


def test_the_stacked_backward_adds_into_each_adapters_own_gradients(tiny_model_path):
    """Each stacked layer names, per adapter, its own `.grad` views: the backward adds there (what
    the segment loop does), onto what an earlier forward_backward left."""
    engine = one_layout_engine(tiny_model_path, 2)
    adapters = [engine.adapter("t0"), engine.adapter("t1")]
    bank = StackedAdapters.for_pass([(adapters[0], 0, 3), (adapters[1], 3, 6)], 6, True, engine.device)
    for path in bank.paths:
        (layer,) = bank.layers([path])
        for adapter, grad_a, grad_b in zip(adapters, layer.grad_a, layer.grad_b):
            assert grad_a is adapter.weights[path].lora_a.grad and grad_b is adapter.weights[path].lora_b.grad
    batch = requests(engine, [7, 5], seed=6)
    for adapter in adapters:
        adapter.flat_grads.fill_(0.5)  # gradients of an earlier call
    engine.forward_backward(batch)
    with_earlier = [a.flat_grads.clone() for a in adapters]
    for adapter in adapters:
        adapter.zero_grad()
    engine.forward_backward(batch)
    for adapter, earlier in zip(adapters, with_earlier):
        assert torch.equal(earlier, (0.5 + adapter.flat_grads))  # 0.5 + P is what G + P adds


def test_adapters_of_different_layouts_are_not_stacked(tiny_model_path):
    engine = TrainerEngine(tiny_model_path)
    a = engine.create_adapter("a", LoraConfig(rank=8))
    b = engine.create_adapter("b", LoraConfig(rank=4))
    c = engine.create_adapter("c", LoraConfig(rank=8, train_unembed=False))
    d = engine.create_adapter("d", LoraConfig(rank=8, alpha=2.0, seed=3))
    e = engine.create_adapter("e", LoraConfig(rank=8, seed=4))
    assert StackedAdapters.for_pass([(a, 0, 4), (b, 4, 8)], 8, True, engine.device) is None
    assert StackedAdapters.for_pass([(a, 0, 4), (c, 4, 8)], 8, True, engine.device) is None
    assert StackedAdapters.for_pass([(a, 0, 4)], 4, True, engine.device) is None  # one adapter: the loop
    lopsided = [(a, 0, 1), (d, 1, 2), (e, 2, 10)]  # a 3 x 8 grid for 10 rows: the loop is cheaper
    assert StackedAdapters.for_pass(lopsided, 10, True, engine.device) is None
    assert StackedAdapters.for_pass([(a, 0, 4), (d, 4, 8)], 8, True, engine.device) is not None


def test_rank_one_adapters_are_not_stacked(tiny_model_path):
    """A rank-1 adapter's products are computed 2 wide (workers/sgmv/row_gemm.py: MKL's one-column
    kernels follow the row count), which its flat weights' views cannot be."""
    engine = TrainerEngine(tiny_model_path)
    a, b = engine.create_adapter("a", LoraConfig(rank=1)), engine.create_adapter("b", LoraConfig(rank=1, seed=1))
    assert StackedAdapters.for_pass([(a, 0, 4), (b, 4, 8)], 8, True, engine.device) is None

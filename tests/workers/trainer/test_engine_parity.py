"""A batch mixing several adapters gives each one exactly what a single-adapter peft model gives it."""

from __future__ import annotations

import pytest
import torch
from loraplex.types import AdamParams

from contract.configs import LoraConfig
from contract.inputs import ForwardBackwardInput
from contract.loss_specs import LOSS_SPECS
from tests.workers.trainer.peft_reference import (
    peft_model_like,
    peft_named,
    random_datum,
    reference_loss,
    rel_err,
    target_logprobs,
)
from workers.trainer.engine import TrainerEngine
from workers.trainer.stacked_adapters import StackedAdapters

TOL = 1e-5
ADAPTER_SETS = {
    # different ranks and targets: each layer's segments are stacked per call (or looped)
    "mixed": {
        "r2-attn": LoraConfig(rank=2, alpha=4, seed=1, train_mlp=False, train_unembed=False),
        "r4-all": LoraConfig(rank=4, alpha=16, seed=2),
        "r8-mlp-unembed": LoraConfig(rank=8, alpha=8, seed=3, train_attn=False),
    },
    # one layout (rank and targets), different alphas: the pass stacks the adapters once
    # (workers/trainer/stacked_adapters.py)
    "one-layout": {
        "r4-a": LoraConfig(rank=4, alpha=4, seed=1),
        "r4-b": LoraConfig(rank=4, alpha=16, seed=2),
        "r4-c": LoraConfig(rank=4, alpha=8, seed=3),
    },
}
ADAM = AdamParams(learning_rate=1e-2, weight_decay=0.1, grad_clip_norm=5.0)


def make_engine(model_path, adapters: dict[str, LoraConfig]) -> TrainerEngine:
    engine = TrainerEngine(model_path)
    gen = torch.Generator().manual_seed(123)
    for adapter_id, cfg in adapters.items():
        adapter = engine.create_adapter(adapter_id, cfg)
        with torch.no_grad():  # B starts at zero; make it non-zero so every gradient is non-trivial
            for w in adapter.weights.values():
                w.lora_b.copy_(0.1 * torch.randn(w.lora_b.shape, generator=gen))
    return engine


def requests_for(loss_fn: str, vocab: int, seed: int, adapters) -> list[ForwardBackwardInput]:
    gen = torch.Generator().manual_seed(seed)
    k = 3 if loss_fn == "cross_entropy" else None
    reqs = []
    for i, adapter_id in enumerate(adapters):
        data = [random_datum(loss_fn, n, gen, vocab) for n in (5 + i, 9, 3)]
        if k:  # one (N, K) datum: several targets per position
            data.append(random_datum(loss_fn, 6, gen, vocab, k=k))
        config = {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1} if loss_fn in ("ppo", "gspo") else None
        if loss_fn == "stable_reinforce":  # a cap that some ratios pass, and the penalty term on
            config = {"clip_high_threshold": 1.1, "kl_coeff": 0.3}
        reqs.append(ForwardBackwardInput(adapter_id, data, loss_fn, config))
    return reqs


def check_against_peft(engine: TrainerEngine, requests, model_path) -> None:
    adapters = [r.adapter_id for r in requests]
    results = engine.forward_backward(requests)
    pre_step_grads = {a: peft_named(engine.adapter(a), lambda p: p.grad.clone()) for a in adapters}
    peft_models = {a: peft_model_like(engine.adapter(a), model_path) for a in adapters}
    engine.optim_step([(a, ADAM) for a in adapters])

    for request, result in zip(requests, results):
        adapter = engine.adapter(request.adapter_id)
        model = peft_models[request.adapter_id]
        config = dict(request.loss_fn_config or {})
        total = torch.zeros(())
        for datum, out in zip(request.data, result.loss_fn_outputs):
            tlp = target_logprobs(model, datum.tokens, datum.loss_fn_inputs["target_tokens"])
            assert rel_err(out["logprobs"], tlp.detach()) <= TOL
            total = total + reference_loss(request.loss_fn, tlp, datum.loss_fn_inputs, config)
        assert abs(result.metrics["loss:sum"] - total.item()) <= TOL * max(1.0, abs(total.item()))
        total.backward()

        peft_params = dict(model.named_parameters())
        for name, ours in pre_step_grads[request.adapter_id].items():
            assert rel_err(ours, peft_params[name].grad) <= TOL, name

        lora_params = [peft_params[name] for name in pre_step_grads[request.adapter_id]]
        torch.nn.utils.clip_grad_norm_(lora_params, ADAM.grad_clip_norm)
        opt = torch.optim.AdamW(
            lora_params, lr=ADAM.learning_rate, betas=(ADAM.beta1, ADAM.beta2), eps=ADAM.eps,
            weight_decay=ADAM.weight_decay,
        )
        opt.step()
        for name, ours in peft_named(adapter, lambda p: p.detach()).items():
            assert rel_err(ours, peft_params[name].detach()) <= TOL, name


@pytest.mark.parametrize("adapter_set", sorted(ADAPTER_SETS))
@pytest.mark.parametrize("loss_fn", sorted(LOSS_SPECS))
def test_batched_matches_single_adapter_peft(loss_fn, adapter_set, tiny_model_path, monkeypatch):
    stacked_passes = spy_on_stacked_passes(monkeypatch)
    adapters = ADAPTER_SETS[adapter_set]
    engine = make_engine(tiny_model_path, adapters)
    check_against_peft(engine, requests_for(loss_fn, engine.vocab_size, 7, adapters), tiny_model_path)
    assert stacked_passes == ([True] if adapter_set == "one-layout" else [False])


def spy_on_stacked_passes(monkeypatch) -> list[bool]:
    """Records, for each pass, whether it stacked its adapters."""
    seen = []
    for_pass = StackedAdapters.for_pass.__func__

    def recording(cls, *args, **kwargs):
        stacked = for_pass(cls, *args, **kwargs)
        seen.append(stacked is not None)
        return stacked

    monkeypatch.setattr(StackedAdapters, "for_pass", classmethod(recording))
    return seen

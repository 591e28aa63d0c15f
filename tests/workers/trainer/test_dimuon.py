"""Dimuon (docs/optimizers.md): each published parameter honoured, its stated properties, tenant isolation."""

from __future__ import annotations

import json
import math

import pytest
import torch
from loraplex.types import AdamParams, DimuonParams

from contract.configs import LoraConfig
from contract.errors import InvalidInputError
from contract.inputs import ForwardBackwardInput
from tests.workers.trainer.peft_reference import random_datum
from workers.trainer.dimuon import directions
from workers.trainer.engine import TrainerEngine


def datums(seed: int, lengths=(7, 4, 11)):
    gen = torch.Generator().manual_seed(seed)
    return [random_datum("cross_entropy", n, gen, 512) for n in lengths]


def engine_with(tiny_model_path, adapters: dict[str, tuple[int, str]]) -> TrainerEngine:
    """An engine with these adapters (id -> (rank, optimizer)), B nonzero so that A has gradients too."""
    engine = TrainerEngine(tiny_model_path)
    for i, (adapter_id, (rank, optimizer)) in enumerate(adapters.items()):
        adapter = engine.create_adapter(adapter_id, LoraConfig(rank=rank, seed=i), optimizer)
        gen = torch.Generator().manual_seed(100 + i)
        with torch.no_grad():
            for w in adapter.weights.values():
                w.lora_b.copy_(0.1 * torch.randn(w.lora_b.shape, generator=gen))
    return engine


def backward(engine: TrainerEngine, adapter_id: str, seed: int) -> None:
    engine.forward_backward([ForwardBackwardInput(adapter_id, datums(seed), "cross_entropy")])


def step_sizes(engine: TrainerEngine, adapter_id: str, params: DimuonParams) -> list[float]:
    """The Frobenius norm of each matrix's change in one step."""
    adapter = engine.adapter(adapter_id)
    before = adapter.flat_weights.clone()
    (result,) = engine.optim_step([(adapter_id, params)])
    assert isinstance(result, dict), result
    return [float(change.norm()) for change in adapter.views(before - adapter.flat_weights)]


@pytest.mark.parametrize("rank", [2, 8])
def test_each_matrix_moves_learning_rate_times_sqrt_rank(tiny_model_path, rank):
    engine = engine_with(tiny_model_path, {"a": (rank, "dimuon")})
    backward(engine, "a", 1)
    sizes = step_sizes(engine, "a", DimuonParams(learning_rate=0.01, rank_lr_correction_exponent=0.0))
    assert sizes == pytest.approx([0.01 * math.sqrt(rank)] * len(sizes), rel=1e-4)


def test_rank_correction_is_relative_to_rank_32(tiny_model_path):
    """(32 / rank) ** exponent times the step: 1x at rank 32 whatever the exponent; 0 disables it."""
    engine = engine_with(tiny_model_path, {"r4": (4, "dimuon"), "r32": (32, "dimuon")})
    for exponent in (0.0, 0.5):
        backward(engine, "r4", 2)
        backward(engine, "r32", 2)
        params = DimuonParams(learning_rate=0.01, rank_lr_correction_exponent=exponent)
        r4, r32 = step_sizes(engine, "r4", params), step_sizes(engine, "r32", params)
        assert r4 == pytest.approx([0.01 * (32 / 4) ** exponent * math.sqrt(4)] * len(r4), rel=1e-4)
        assert r32 == pytest.approx([0.01 * math.sqrt(32)] * len(r32), rel=1e-4)


@pytest.mark.parametrize("grad_clip_norm, clipped", [(0.05, True), (0.0, False), (-1.0, False)])
def test_the_gradient_is_clipped_before_the_momentum(tiny_model_path, grad_clip_norm, clipped):
    """The first step's momentum is (1 - beta1) * the (clipped) gradient; a bound <= 0 clips nothing."""
    engine = engine_with(tiny_model_path, {"a": (4, "dimuon")})
    backward(engine, "a", 3)
    gradient = engine.adapter("a").flat_grads.clone()
    (result,) = engine.optim_step([("a", DimuonParams(learning_rate=0.01, beta1=0.75, grad_clip_norm=grad_clip_norm))])
    assert result["grad_norm"] == pytest.approx(float(gradient.norm()))
    expected = 0.25 * gradient * (grad_clip_norm / float(gradient.norm()) if clipped else 1.0)
    torch.testing.assert_close(engine.adapter("a").optimizer_state["momentum"], expected, rtol=1e-5, atol=1e-9)


def test_beta1_and_damping_each_change_the_step(tiny_model_path):
    engine = engine_with(tiny_model_path, {name: (4, "dimuon") for name in ("default", "beta1", "damping")})
    for name in engine.adapters:  # two steps: beta1 matters from the second on
        backward(engine, name, 4)
    engine.optim_step([(name, DimuonParams(learning_rate=0.01)) for name in engine.adapters])
    for name in engine.adapters:
        backward(engine, name, 5)
    engine.optim_step([("default", DimuonParams(learning_rate=0.01)), ("beta1", DimuonParams(0.01, beta1=0.0)),
                       ("damping", DimuonParams(0.01, damping=10.0))])
    weights = {name: adapter.flat_weights for name, adapter in engine.adapters.items()}
    assert not torch.equal(weights["default"], weights["beta1"])
    assert not torch.equal(weights["default"], weights["damping"])


def test_a_zero_momentum_is_a_zero_step_and_damping_smooths_toward_plain_muon():
    assert torch.equal(directions(torch.zeros(2, 4, 16), 4, 1e-4), torch.zeros(2, 4, 16))
    momentum = torch.randn(1, 4, 16, generator=torch.Generator().manual_seed(0)) * torch.logspace(0, 2, 16)
    plain = directions(momentum, 4, 1e12)  # so damped that the row and column scales are all alike
    sharp = directions(momentum, 4, 1e-4)
    reference = torch.linalg.svd(momentum[0], full_matrices=False)
    msign = reference.U @ reference.Vh  # U V^T: Frobenius norm sqrt(4) already
    assert float((plain[0] - msign).norm()) < 0.35 * float(msign.norm())  # Newton-Schulz: an approximate msign
    assert float((sharp[0] - plain[0]).norm()) > 0.1 * float(plain[0].norm())


def test_one_step_call_over_many_tenants_equals_each_alone(tiny_model_path):
    """Dimuon and AdamW adapters of different ranks, co-stepped, give each the bits it gets alone."""
    adapters = {"d2": (2, "dimuon"), "d8": (8, "dimuon"), "adam": (4, "adamw"), "d4": (4, "dimuon")}
    together, alone = engine_with(tiny_model_path, adapters), engine_with(tiny_model_path, adapters)
    steps = [("d2", DimuonParams(0.02)), ("d8", DimuonParams(0.01, grad_clip_norm=0.1, damping=0.5)),
             ("adam", AdamParams(1e-2)), ("d4", DimuonParams(0.03, beta1=0.5))]
    for engine in (together, alone):
        for seed in (6, 7):
            for adapter_id in adapters:
                backward(engine, adapter_id, seed)
            results = engine.optim_step(steps) if engine is together else [engine.optim_step([s])[0] for s in steps]
        engine.results = results
    assert together.results == alone.results
    for adapter_id in adapters:
        mine, reference = together.adapter(adapter_id), alone.adapter(adapter_id)
        assert torch.equal(mine.flat_weights, reference.flat_weights), adapter_id
        for kind, tensor in mine.optimizer_state.items():
            assert torch.equal(tensor, reference.optimizer_state[kind]), (adapter_id, kind)


def test_params_of_the_other_optimizer_fail_that_adapter_alone(tiny_model_path):
    engine = engine_with(tiny_model_path, {"d": (4, "dimuon"), "a": (4, "adamw")})
    for adapter_id in "da":
        backward(engine, adapter_id, 8)
    before = engine.adapter("d").flat_weights.clone()
    wrong, right = engine.optim_step([("d", AdamParams(1e-3)), ("a", AdamParams(1e-3))])
    assert isinstance(wrong, InvalidInputError) and "optimizer_params.type" in str(wrong)
    assert isinstance(right, dict)
    assert torch.equal(engine.adapter("d").flat_weights, before) and engine.adapter("d").step == 0


def test_dimuon_state_survives_save_and_load(tiny_model_path, tmp_path):
    """Resumed with its optimizer, the next step has the same bits as without the save; loaded weights-only,
    it gets a fresh momentum (and the optimizer asked for)."""
    engine = engine_with(tiny_model_path, {"a": (4, "dimuon")})
    backward(engine, "a", 9)
    engine.optim_step([("a", DimuonParams(0.02))])
    engine.save_state("a", tmp_path / "state")
    engine.load_state("resumed", tmp_path / "state")
    engine.load_state("fresh", tmp_path / "state", with_optimizer=False, optimizer="dimuon")
    assert engine.adapter("resumed").optimizer == "dimuon" and engine.adapter("resumed").step == 1
    assert engine.adapter("fresh").optimizer_state == {} and engine.adapter("fresh").step == 0
    for adapter_id in ("a", "resumed", "fresh"):
        backward(engine, adapter_id, 10)
    engine.optim_step([(adapter_id, DimuonParams(0.02)) for adapter_id in ("a", "resumed", "fresh")])
    assert torch.equal(engine.adapter("resumed").flat_weights, engine.adapter("a").flat_weights)
    assert not torch.equal(engine.adapter("fresh").flat_weights, engine.adapter("a").flat_weights)
    with pytest.raises(Exception, match="dimuon's, not adamw's"):
        engine.load_state("wrong", tmp_path / "state", optimizer="adamw")


def test_dimuon_runs_paged_out_between_steps_continue_exactly(tiny_model_path, tmp_path):
    """A trainer with room for one run pages the others out (momentum, step and gradients written, read
    back on use): every run's numbers equal those of a trainer that keeps them all."""
    from contract.queue import Cycle
    from loraplex.wire.client import decode_forward_backward_output
    from tests.workers.trainer.test_eviction import TOKENS, forward_backward, request
    from workers.trainer.executor import InProcessExecutor

    def create(model):
        body = {"lora_config": {"rank": 4, "seed": ord(model)}, "optimizer": "dimuon"}
        return request(model, 0, "create_model", json.dumps(body).encode())

    def step(model, seq):
        body = {"adam_params": {"learning_rate": 0.02, "grad_clip_norm": 0.0, "beta1": 0.9, "damping": 1e-4,
                                "rank_lr_correction_exponent": 0.175}}
        return request(model, seq, "optim_step", json.dumps(body).encode())

    def run(executor) -> dict[str, list[float]]:
        cycles = [[create(m)] for m in TOKENS]
        for seq in (1, 3):  # forward_backward, then a step: the momentum of the first step shapes the second
            cycles += [[forward_backward(m, seq)] for m in TOKENS] + [[step(m, seq + 1)] for m in TOKENS]
        cycles += [[forward_backward(m, 5, forward_only=True)] for m in TOKENS]
        logprobs = {}
        for jobs in cycles:
            kind = jobs[0][0].kind
            cycle = Cycle(forward_backward=[q for q, _ in jobs] if kind in ("forward", "forward_backward") else [],
                          optim_steps=[q for q, _ in jobs] if kind == "optim_step" else [],
                          others=[q for q, _ in jobs] if kind == "create_model" else [])
            outcomes = executor.run_cycle(cycle, {q.id: job for q, job in jobs})
            assert all(o.error is None for o in outcomes.values()), outcomes
            if kind == "forward":
                q = jobs[0][0]
                logprobs[q.model_id] = decode_forward_backward_output(outcomes[q.id].result)[0][0]["logprobs"].tolist()
        assert all(adapter.optimizer == "dimuon" for adapter in executor.engine.adapters.values())
        return logprobs

    kept = run(InProcessExecutor(TrainerEngine(tiny_model_path, max_rank=16), tmp_path / "all"))
    paged = run(InProcessExecutor(TrainerEngine(tiny_model_path, max_rank=16), tmp_path / "one", max_resident=1))
    assert paged == kept


def test_what_a_run_will_hold_after_a_step_is_known_before_it(tiny_model_path):
    """create_model refuses a run whose stepped state exceeds the memory budget: its size counts the
    optimizer's own state (one momentum for Dimuon, two moments for AdamW)."""
    engine = engine_with(tiny_model_path, {"d": (4, "dimuon"), "a": (4, "adamw")})
    expected = {name: engine.adapter(name).stepped_bytes for name in ("d", "a")}
    for name, params in (("d", DimuonParams(learning_rate=0.01)), ("a", AdamParams(learning_rate=0.01))):
        backward(engine, name, seed=1)
        engine.optim_step([(name, params)])
        scalar = 4 if name == "a" else 0  # AdamW's step counter, a float32 scalar (not counted: negligible)
        assert engine.adapter(name).resident_bytes == expected[name] + scalar
    assert expected["d"] * 4 == expected["a"] * 3

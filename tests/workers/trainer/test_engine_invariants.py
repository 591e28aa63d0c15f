"""Batch invariance, tenant isolation, sum semantics and gradient accumulation of the engine."""

from __future__ import annotations

import pytest
import torch
from loraplex.types import AdamParams

from contract.configs import LoraConfig
from contract.inputs import EngineDatum, ForwardBackwardInput
from models.registry import resolve_model
from tests.workers.trainer.peft_reference import peft_model_like, random_datum, rel_err, target_logprobs
from workers.trainer.engine import TrainerEngine


@pytest.fixture
def engine(tiny_model_path):
    return three_adapter_engine(tiny_model_path)


def three_adapter_engine(model_path):
    engine = TrainerEngine(model_path)
    gen = torch.Generator().manual_seed(5)
    for i, adapter_id in enumerate(["a", "b", "c"]):
        adapter = engine.create_adapter(adapter_id, LoraConfig(rank=2 + 2 * i, seed=i))
        with torch.no_grad():
            for w in adapter.weights.values():
                w.lora_b.copy_(0.1 * torch.randn(w.lora_b.shape, generator=gen))
    return engine


def datums(loss_fn: str, seed: int, lengths=(7, 4, 11), vocab=512):
    gen = torch.Generator().manual_seed(seed)
    return [random_datum(loss_fn, n, gen, vocab) for n in lengths]


def grads(engine, adapter_id):
    return {n: p.grad.clone() for n, p in engine.adapter(adapter_id).named_parameters()}


@pytest.mark.parametrize("loss_fn", ["ppo", "stable_reinforce"])
def test_result_does_not_depend_on_the_rest_of_the_batch(engine, loss_fn):
    mine = ForwardBackwardInput("a", datums(loss_fn, 1), loss_fn)
    alone = engine.forward_backward([mine])[0]
    grads_alone = grads(engine, "a")
    engine.adapter("a").zero_grad()

    crowd = [
        ForwardBackwardInput("b", datums("cross_entropy", 2, (30, 2)), "cross_entropy"),
        ForwardBackwardInput("c", datums("importance_sampling", 3), "importance_sampling"),
        ForwardBackwardInput("b", datums("gspo", 4), "gspo", forward_only=True),
        # another tenant's stable_reinforce, so a stable_reinforce `mine` shares its loss call
        ForwardBackwardInput("c", datums("stable_reinforce", 5, (9, 6)), "stable_reinforce"),
    ]
    together = engine.forward_backward([crowd[0], mine, *crowd[1:]])[1]
    # stable_reinforce's terms are A * logprob (~6|A| each, on the tiny model) and cancel in the sum:
    # its float32 noise is relative to the terms' size, not to the sum's
    terms = sum((d.loss_fn_inputs["advantages"] * o["logprobs"]).abs().sum().item()
                for d, o in zip(mine.data, alone.loss_fn_outputs))
    noise = 1e-7 * terms if loss_fn == "stable_reinforce" else 0.0
    assert together.metrics["loss:sum"] == pytest.approx(alone.metrics["loss:sum"], rel=1e-6, abs=noise)
    for a, b in zip(together.loss_fn_outputs, alone.loss_fn_outputs):
        torch.testing.assert_close(a["logprobs"], b["logprobs"], rtol=1e-6, atol=1e-6)
    for name, g in grads(engine, "a").items():
        assert rel_err(g, grads_alone[name]) <= 1e-5, name


def test_optim_step_of_one_adapter_leaves_others_bit_identical(engine):
    for adapter_id in "abc":
        engine.forward_backward([ForwardBackwardInput(adapter_id, datums("cross_entropy", 9), "cross_entropy")])
    engine.optim_step([(a, AdamParams(1e-3)) for a in "bc"])  # b has optimizer state from here on
    engine.forward_backward([ForwardBackwardInput("b", datums("cross_entropy", 10), "cross_entropy")])
    b = engine.adapter("b")
    before = {n: p.detach().clone() for n, p in b.named_parameters()}
    grads_before = grads(engine, "b")
    moments_before = {k: v.clone() for k, v in b.optimizer_state.items()}

    brutal = AdamParams(learning_rate=10.0, weight_decay=0.9, grad_clip_norm=1e-3)
    engine.optim_step([("a", brutal), ("c", brutal)])

    for n, p in b.named_parameters():
        assert torch.equal(p.detach(), before[n]), n
        assert torch.equal(p.grad, grads_before[n]), n
    for k, v in b.optimizer_state.items():
        assert torch.equal(v, moments_before[k]), k
    assert b.step == 1 and engine.adapter("a").step == 1 and engine.adapter("c").step == 2


def test_one_optim_step_call_equals_each_adapter_stepped_alone(engine, tiny_model_path):
    """Adapters at different step counts, with different hyperparameters (one set shared by two,
    so they share a fused call), and one adapter listed twice (it steps twice)."""
    alone = three_adapter_engine(tiny_model_path)
    plain, clipped = AdamParams(1e-2, weight_decay=0.1), AdamParams(3e-2, beta2=0.99, grad_clip_norm=0.5)
    steps = [("a", plain), ("b", clipped), ("c", plain), ("a", plain)]
    for e in (engine, alone):
        for adapter_id in "abc":
            e.forward_backward([ForwardBackwardInput(adapter_id, datums("cross_entropy", 20), "cross_entropy")])
        e.optim_step([("b", plain)])
        for adapter_id in "abc":
            e.forward_backward([ForwardBackwardInput(adapter_id, datums("ppo", 21), "ppo")])

    together = engine.optim_step(steps)
    separately = [alone.optim_step([step])[0] for step in steps]

    assert together == separately  # grad_norm, learning_rate and step of each
    assert [engine.adapter(a).step for a in "abc"] == [2, 2, 1]
    for adapter_id in "abc":
        mine, reference = engine.adapter(adapter_id), alone.adapter(adapter_id)
        for (n, p), q in zip(mine.named_parameters(), reference.parameters()):
            assert torch.equal(p.detach(), q.detach()), n
        for k, v in mine.optimizer_state.items():
            assert torch.equal(v, reference.optimizer_state[k]), (adapter_id, k)


def test_weights_times_two_doubles_the_loss(engine):
    data = datums("cross_entropy", 11)
    once = engine.forward([ForwardBackwardInput("a", data)])[0].metrics["loss:sum"]
    doubled = [EngineDatum(d.tokens, {**d.loss_fn_inputs, "weights": 2 * d.loss_fn_inputs["weights"]}) for d in data]
    twice = engine.forward([ForwardBackwardInput("a", doubled)])[0].metrics["loss:sum"]
    assert twice == pytest.approx(2 * once, rel=1e-6)


def test_duplicated_datum_doubles_loss_and_gradient(engine):
    datum = datums("importance_sampling", 12, lengths=(9,))[0]
    single = engine.forward_backward([ForwardBackwardInput("a", [datum], "importance_sampling")])[0]
    g_single = grads(engine, "a")
    engine.adapter("a").zero_grad()
    double = engine.forward_backward([ForwardBackwardInput("a", [datum, datum], "importance_sampling")])[0]
    assert double.metrics["loss:sum"] == pytest.approx(2 * single.metrics["loss:sum"], rel=1e-6)
    for n, g in grads(engine, "a").items():
        assert rel_err(g, 2 * g_single[n]) <= 1e-5


def test_negative_weights_stay_finite(engine):
    data = datums("cross_entropy", 13)
    negative = [EngineDatum(d.tokens, {**d.loss_fn_inputs, "weights": -d.loss_fn_inputs["weights"] - 1}) for d in data]
    out = engine.forward_backward([ForwardBackwardInput("a", negative)])[0]
    assert torch.isfinite(torch.tensor(out.metrics["loss:sum"])) and out.metrics["loss:sum"] < 0  # -logp * w, w < 0
    assert all(torch.isfinite(p.grad).all() for p in engine.adapter("a").parameters())


def test_gradients_accumulate_until_optim_step(engine):
    first, second = datums("cross_entropy", 14), datums("cross_entropy", 15)
    engine.forward_backward([ForwardBackwardInput("a", first)])
    g_first = grads(engine, "a")
    engine.adapter("a").zero_grad()
    engine.forward_backward([ForwardBackwardInput("a", second)])
    g_second = grads(engine, "a")
    engine.adapter("a").zero_grad()

    engine.forward_backward([ForwardBackwardInput("a", first)])
    engine.forward_backward([ForwardBackwardInput("a", second)])
    for n, g in grads(engine, "a").items():
        assert rel_err(g, g_first[n] + g_second[n]) <= 1e-5
    engine.optim_step([("a", AdamParams(1e-3))])
    assert not engine.adapter("a").has_gradients()


def test_forward_only_leaves_no_gradient(engine):
    out = engine.forward([ForwardBackwardInput("a", datums("dro", 16), "dro")])[0]
    assert len(out.loss_fn_outputs) == 3 and not engine.adapter("a").has_gradients()


@pytest.mark.parametrize("family", ["tiny-qwen2", "tiny-qwen3"])
def test_other_model_families_match_peft(family):
    path = resolve_model(family)
    engine = TrainerEngine(path)
    adapter = engine.create_adapter("x", LoraConfig(rank=4, seed=3))
    with torch.no_grad():
        for w in adapter.weights.values():
            w.lora_b.normal_(0, 0.1)
    data = datums("cross_entropy", 17)
    out = engine.forward([ForwardBackwardInput("x", data)])[0]
    model = peft_model_like(adapter, path)
    for d, o in zip(data, out.loss_fn_outputs):
        expected = target_logprobs(model, d.tokens, d.loss_fn_inputs["target_tokens"]).detach()
        assert rel_err(o["logprobs"], expected) <= 1e-5


def test_a_batch_split_into_several_passes_gives_the_same_results(engine, tiny_model_path):
    requests = [
        ForwardBackwardInput("a", datums("gspo", 20, lengths=(7, 9, 5, 11)), "gspo"),
        ForwardBackwardInput("b", datums("cross_entropy", 21, lengths=(30, 2))),
        ForwardBackwardInput("c", datums("stable_reinforce", 22, lengths=(8, 6, 10)), "stable_reinforce"),
    ]
    whole = engine.forward_backward(requests)
    grads_whole = {a: grads(engine, a) for a in "abc"}
    for a in "abc":
        engine.adapter(a).zero_grad()
    engine.max_pass_tokens = 12  # every pass holds one or two datums; the 30-token one goes alone
    split = engine.forward_backward(requests)
    for w, s in zip(whole, split):
        assert s.metrics["loss:sum"] == pytest.approx(w.metrics["loss:sum"], rel=1e-6)
        for x, y in zip(w.loss_fn_outputs, s.loss_fn_outputs):
            torch.testing.assert_close(x["logprobs"], y["logprobs"], rtol=1e-6, atol=1e-6)
    for a in "abc":
        for name, g in grads(engine, a).items():
            assert rel_err(g, grads_whole[a][name]) <= 1e-5, name


def test_a_step_on_non_finite_gradients_is_refused_and_leaves_the_adapter_as_it_was(engine):
    """Finite inputs can still overflow: importance_sampling with a sampler logprob of -1e30 makes
    the ratio inf. That adapter's step fails (user error) without touching its state; the others
    in the same call step."""
    overflowing = datums("importance_sampling", 20)
    overflowing[0].loss_fn_inputs["logprobs"][0] = -1e30
    engine.forward_backward([ForwardBackwardInput("a", overflowing, "importance_sampling"),
                             ForwardBackwardInput("b", datums("cross_entropy", 21), "cross_entropy")])
    a = engine.adapter("a")
    assert not all(torch.isfinite(p.grad).all() for p in a.parameters())
    before = {n: p.detach().clone() for n, p in a.named_parameters()}

    result_a, result_b = engine.optim_step([("a", AdamParams(1e-2)), ("b", AdamParams(1e-2))])
    assert result_a.category == "user" and result_a.field == "gradients" and "NaN or inf" in str(result_a)
    assert result_b["step"] == 1.0 and result_b["grad_norm"] > 0
    assert a.step == 0 and not a.has_gradients() and not a.optimizer_state
    for n, p in a.named_parameters():
        assert torch.equal(p, before[n]), n

    engine.forward_backward([ForwardBackwardInput("a", datums("cross_entropy", 22), "cross_entropy")])
    assert engine.optim_step([("a", AdamParams(1e-2))])[0]["step"] == 1.0  # and it trains on


def test_every_matrix_and_its_gradient_is_a_view_of_the_adapters_flat_tensors(engine):
    """The optimizer updates the flat tensors: the matrices the layers read must be views of them."""
    a = engine.adapter("a")
    assert not a.has_gradients() and not a.flat_grads.any()
    engine.forward_backward([ForwardBackwardInput("a", datums("cross_entropy", 30), "cross_entropy")])
    assert a.has_gradients() and a.flat_grads.any()
    assert torch.equal(torch.cat([p.grad.flatten() for p in a.parameters()]), a.flat_grads)
    before = a.flat_weights.clone()
    engine.optim_step([("a", AdamParams(1e-2))])
    assert not torch.equal(a.flat_weights, before)
    assert torch.equal(torch.cat([p.detach().flatten() for p in a.parameters()]), a.flat_weights)
    assert not a.has_gradients() and not a.flat_grads.any()  # the step cleared them
    assert all(p.untyped_storage().data_ptr() == a.flat_weights.untyped_storage().data_ptr() for p in a.parameters())


def test_adamw_clips_the_gradient_to_grad_clip_norm(engine):
    """The first step's exp_avg is (1 - beta1) * the gradient scaled down to grad_clip_norm."""
    engine.forward_backward([ForwardBackwardInput("a", datums("cross_entropy", 13), "cross_entropy")])
    gradient = engine.adapter("a").flat_grads.clone()
    clip = 0.1 * float(gradient.norm())
    (result,) = engine.optim_step([("a", AdamParams(1e-2, grad_clip_norm=clip))])
    assert result["grad_norm"] == pytest.approx(float(gradient.norm()))  # reported before clipping
    torch.testing.assert_close(engine.adapter("a").optimizer_state["exp_avg"], 0.1 * 0.1 * gradient)

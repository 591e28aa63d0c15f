"""Datums of one request that begin alike share those rows, and every result stays what it is alone."""

from __future__ import annotations

import pytest
import torch

from contract.configs import LoraConfig
from contract.inputs import EngineDatum, ForwardBackwardInput
from service.settings import Settings
from tests.workers.trainer.peft_reference import peft_model_like, random_datum, rel_err, target_logprobs
from workers.trainer.batch import pack, prepare_request
from workers.trainer.engine import TrainerEngine
from workers.trainer.shared_prefix import MIN_SHARED_TOKENS, group_mask, share_plan

VOCAB = 512


def test_share_plan_groups_datums_behind_the_first_that_begins_alike():
    t = torch.tensor
    tokens = [t([1, 2, 3, 4]), t([1, 2, 3, 9, 9]), t([1, 2, 3, 4]), t([7, 2, 3]), t([7, 2, 5]), t([1, 2, 3, 4])]
    # a duplicate keeps its last row; [7, 2, 3] leads a new group; the last datum shares nothing with it
    assert share_plan(tokens, min_shared=2) == [0, 3, 3, 0, 2, 0]
    assert share_plan(tokens, min_shared=3) == [0, 3, 3, 0, 0, 0]
    assert share_plan(tokens, min_shared=0) == [0] * 6


def test_the_service_default_is_the_engine_default():
    assert Settings().trainer_min_shared_prefix == MIN_SHARED_TOKENS


def test_group_mask_lets_a_member_see_only_the_shared_rows_and_its_own():
    # leader of 3 rows; member 1 shares 2 rows and has 2 of its own; member 2 shares 3, has 1
    mask = group_mask(3, [(2, 2), (3, 1)])
    expected = torch.tensor([
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0],
        [1, 1, 0, 1, 0, 0],  # member 1, position 2: leader rows 0-1, then itself
        [1, 1, 0, 1, 1, 0],
        [1, 1, 1, 0, 0, 1],  # member 2, position 3: all three leader rows, then itself
    ], dtype=torch.bool)
    assert torch.equal(mask, expected)


def rl_group(gen: torch.Generator, prompt_len: int, completion_lens, loss_fn: str) -> list[EngineDatum]:
    """One prompt and several completions of it, as an RL step sends them."""
    prompt = torch.randint(0, VOCAB, (prompt_len,), generator=gen)
    data = []
    for n in completion_lens:
        sequence = torch.cat([prompt, torch.randint(0, VOCAB, (n,), generator=gen)])
        datum = random_datum(loss_fn, sequence.numel() - 1, gen, VOCAB)
        datum.loss_fn_inputs["target_tokens"] = sequence[1:]
        data.append(EngineDatum(sequence[:-1], datum.loss_fn_inputs))
    return data


def add_adapter(engine: TrainerEngine, adapter_id: str, config: LoraConfig, seed: int) -> None:
    """An adapter with a non-zero B (a fresh one's is zero), the same for the same seed."""
    adapter = engine.create_adapter(adapter_id, config)
    with torch.no_grad():
        for i, w in enumerate(adapter.weights.values()):
            w.lora_b.normal_(0, 0.1, generator=torch.Generator().manual_seed(seed + i))


def engines(model_path):
    """The same adapter in an engine that shares rows and one that never does."""
    pair = []
    for min_shared in (8, 0):
        engine = TrainerEngine(model_path, min_shared_prefix=min_shared)
        add_adapter(engine, "a", LoraConfig(rank=4, seed=1), seed=0)
        pair.append(engine)
    return pair


def grads(engine):
    return {n: p.grad.clone() for n, p in engine.adapter("a").named_parameters()}


@pytest.mark.parametrize("loss_fn", ["ppo", "gspo", "cross_entropy"])
def test_shared_rows_give_each_datum_its_result_alone(loss_fn, tiny_model_path):
    gen = torch.Generator().manual_seed(11)
    # two groups, an unrelated datum between them, a duplicate and a completion of one token
    data = (rl_group(gen, 20, (5, 9, 1, 5), loss_fn) + [random_datum(loss_fn, 12, gen, VOCAB)]
            + rl_group(gen, 30, (3, 7, 4), loss_fn))
    data.insert(4, EngineDatum(data[0].tokens.clone(), {k: v.clone() for k, v in data[0].loss_fn_inputs.items()}))
    if loss_fn == "cross_entropy":  # a member with several targets per position
        n = data[1].tokens.numel()
        data.insert(2, EngineDatum(data[1].tokens, {"target_tokens": torch.randint(0, VOCAB, (n, 3), generator=gen),
                                              "weights": torch.rand(n, 3, generator=gen)}))
    sharing, plain = engines(tiny_model_path)
    request = ForwardBackwardInput("a", data, loss_fn)

    prepared = [prepare_request(0, request, sharing.vocab_size, sharing.max_seq_len)]
    packed = pack(prepared, sharing.min_shared_prefix)
    positions = sum(d.tokens.numel() for d in data)
    members = len(data) - 3  # all but the two leaders and the unrelated datum
    assert packed.input_ids.numel() <= positions - (members - 2) * 19 - 2 * 29  # each prompt computed once

    ours, reference = sharing.forward_backward([request])[0], plain.forward_backward([request])[0]
    assert ours.metrics["loss:sum"] == pytest.approx(reference.metrics["loss:sum"], rel=1e-5)
    for a, b in zip(ours.loss_fn_outputs, reference.loss_fn_outputs):
        assert a["logprobs"].shape == b["logprobs"].shape
        torch.testing.assert_close(a["logprobs"], b["logprobs"], rtol=1e-5, atol=1e-5)
    g_ours, g_ref = grads(sharing), grads(plain)
    for name, g in g_ours.items():
        assert rel_err(g, g_ref[name]) <= 1e-5, name

    model = peft_model_like(sharing.adapter("a"), tiny_model_path)
    for d, out in zip(data, ours.loss_fn_outputs):
        expected = target_logprobs(model, d.tokens, d.loss_fn_inputs["target_tokens"]).detach()
        assert rel_err(out["logprobs"], expected) <= 1e-5


def test_a_group_cut_by_a_pass_boundary_gives_the_same_results(tiny_model_path):
    gen = torch.Generator().manual_seed(12)
    data = rl_group(gen, 24, (6, 6, 2, 8, 5, 3), "importance_sampling")
    sharing, plain = engines(tiny_model_path)
    request = ForwardBackwardInput("a", data, "importance_sampling")
    reference = plain.forward_backward([request])[0]
    sharing.max_pass_tokens = 48  # a leader (~30 rows) and a few members' tails per pass
    ours = sharing.forward_backward([request])[0]
    assert ours.metrics["loss:sum"] == pytest.approx(reference.metrics["loss:sum"], rel=1e-5)
    for a, b in zip(ours.loss_fn_outputs, reference.loss_fn_outputs):
        torch.testing.assert_close(a["logprobs"], b["logprobs"], rtol=1e-5, atol=1e-5)
    g_ref = grads(plain)
    for name, g in grads(sharing).items():
        assert rel_err(g, g_ref[name]) <= 1e-5, name


def test_rows_are_never_shared_across_requests(tiny_model_path):
    gen = torch.Generator().manual_seed(13)
    data = rl_group(gen, 20, (4, 4), "cross_entropy")
    sharing, _ = engines(tiny_model_path)
    sharing.create_adapter("b", LoraConfig(rank=2, seed=2))
    requests = [ForwardBackwardInput("a", data[:1]), ForwardBackwardInput("b", data[1:]),
                ForwardBackwardInput("a", data[1:])]
    prepared = [prepare_request(i, r, sharing.vocab_size, sharing.max_seq_len) for i, r in enumerate(requests)]
    packed = pack(prepared, sharing.min_shared_prefix)
    assert packed.input_ids.numel() == sum(d.tokens.numel() for d in data) + data[1].tokens.numel()
    assert packed.position_rows is None


def test_tenants_with_the_same_prompt_each_get_their_own_numbers(tiny_model_path):
    """Two adapters' groups of one prompt in one batch: each equals its run alone without sharing."""
    gen = torch.Generator().manual_seed(14)
    data = rl_group(gen, 20, (6, 3, 8), "ppo")
    sharing, plain = engines(tiny_model_path)
    for engine in (sharing, plain):
        add_adapter(engine, "b", LoraConfig(rank=8, seed=2), seed=100)
    requests = [ForwardBackwardInput("a", data, "ppo"), ForwardBackwardInput("b", data, "ppo")]
    together = sharing.forward_backward(requests)
    for request, ours in zip(requests, together):
        alone = plain.forward_backward([request])[0]
        assert ours.metrics["loss:sum"] == pytest.approx(alone.metrics["loss:sum"], rel=1e-5)
        for a, b in zip(ours.loss_fn_outputs, alone.loss_fn_outputs):
            torch.testing.assert_close(a["logprobs"], b["logprobs"], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(together[0].loss_fn_outputs[0]["logprobs"], together[1].loss_fn_outputs[0]["logprobs"])
    for adapter_id in "ab":
        ours = {n: p.grad for n, p in sharing.adapter(adapter_id).named_parameters()}
        for name, g in plain.adapter(adapter_id).named_parameters():
            assert rel_err(ours[name], g.grad) <= 1e-5, (adapter_id, name)

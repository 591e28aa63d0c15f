"""A request run in parts over several engine calls gets the bits it gets whole and alone, and its
parts' results merge as the Tinker SDK merges the chunks of a large request."""

from __future__ import annotations

import pytest
import torch
from loraplex.types import AdamParams

from contract.configs import LoraConfig
from contract.errors import InvalidInputError
from contract.inputs import ForwardBackwardInput
from tests.workers.trainer.peft_reference import random_datum
from tests.workers.trainer.test_shared_prefix import VOCAB, add_adapter, rl_group
from workers.trainer.batch import prepare_request, split_into_passes
from workers.trainer.engine import TrainerEngine
from workers.trainer.parts import SplitRun, merge_metrics


def test_metrics_merge_as_the_tinker_sdk_merges_chunks():
    pieces = [({"loss:sum": 1.5, "ratio:mean": 2.0, "lo:min": 3.0, "hi:max": 1.0, "odd:slack": 9.0, "x:sum": 1.0}, 1),
              ({"loss:sum": 2.25, "ratio:mean": 5.0, "lo:min": -1.0, "hi:max": 7.0, "odd:slack": 9.0}, 3)]
    # :mean weighted by datums; Tinker's other reductions, and a metric one piece lacks, are left out
    assert merge_metrics(pieces) == {"loss:sum": 3.75, "ratio:mean": (2.0 + 15.0) / 4, "lo:min": -1.0, "hi:max": 7.0}
    assert merge_metrics([]) == {}


def test_a_sum_adds_up_left_to_right_from_zero_as_the_engine_adds_its_passes():
    values = [0.1, 1e16, -1e16, 0.2]  # float addition is not associative: the order is the result
    expected = 0.0
    for v in values:
        expected += v
    assert merge_metrics([({"loss:sum": v}, 1) for v in values])["loss:sum"] == expected != sum(values[1:]) + values[0]


def test_a_request_with_passes_of_its_own_shares_none():
    gen = torch.Generator().manual_seed(1)
    small = ForwardBackwardInput("a", [random_datum("cross_entropy", 5, gen, VOCAB)])
    own = ForwardBackwardInput("b", [random_datum("cross_entropy", 6, gen, VOCAB) for _ in range(3)], own_passes=True)
    prepared = [prepare_request(i, r, VOCAB, 2048) for i, r in enumerate([small, own, small])]
    passes = split_into_passes(prepared, max_tokens=100)
    assert [[p.index for p in pass_] for pass_ in passes] == [[0], [1], [2]]
    assert [p.index for p in split_into_passes([prepared[0], prepared[2]], max_tokens=100)[0]] == [0, 2]


def engine_with_adapter(model_path, adapters=("a",)) -> TrainerEngine:
    engine = TrainerEngine(model_path, max_rank=16)
    for i, adapter_id in enumerate(adapters):
        add_adapter(engine, adapter_id, LoraConfig(rank=4, seed=i), seed=10 * i)
    return engine


def mixed_data(gen: torch.Generator, loss_fn: str):
    """Two RL groups (shared prompts) around plain datums: 20 datums, ~700 tokens."""
    plain = [random_datum(loss_fn, n, gen, VOCAB) for n in (17, 40, 9, 33, 25)]
    return (rl_group(gen, 30, (6, 12, 3, 20, 8, 15), loss_fn) + plain[:2]
            + rl_group(gen, 45, (10, 4, 18, 7, 9), loss_fn) + plain[2:] + rl_group(gen, 12, (5, 5), loss_fn))


def run_in_parts(engine: TrainerEngine, request: ForwardBackwardInput, max_tokens: int, crowd=()):
    """The request's parts, each in an engine call of its own beside `crowd` (other adapters' requests)."""
    split = SplitRun.begin("r", request, engine.vocab_size, engine.max_seq_len)
    calls = 0
    while not split.complete:
        part = split.next_input(max_tokens, engine.max_pass_tokens, engine.min_shared_prefix)
        results = engine.forward_backward([*crowd, part])
        split.add(results[-1])
        calls += 1
    return split.result(), calls


@pytest.mark.parametrize("loss_fn", ["cross_entropy", "ppo", "gspo"])
def test_parts_give_the_bits_of_the_whole_request_alone(loss_fn, tiny_model_path):
    gen = torch.Generator().manual_seed(3)
    request = ForwardBackwardInput("a", mixed_data(gen, loss_fn), loss_fn)
    whole_engine, parts_engine = engine_with_adapter(tiny_model_path), engine_with_adapter(tiny_model_path, ("a", "b"))
    whole_engine.max_pass_tokens = parts_engine.max_pass_tokens = 64  # a dozen passes, groups cut by some
    whole = whole_engine.forward_backward([request])[0]
    crowd = [ForwardBackwardInput("b", [random_datum("cross_entropy", 21, gen, VOCAB)])]  # another tenant's, each call
    merged, calls = run_in_parts(parts_engine, request, max_tokens=150, crowd=crowd)
    assert calls > 3
    assert merged.metrics == whole.metrics  # bitwise: the same passes, added in the same order
    assert len(merged.loss_fn_outputs) == len(whole.loss_fn_outputs)
    for got, want in zip(merged.loss_fn_outputs, whole.loss_fn_outputs):
        assert torch.equal(got["logprobs"], want["logprobs"])
    assert torch.equal(parts_engine.adapter("a").flat_grads, whole_engine.adapter("a").flat_grads)
    for engine in (whole_engine, parts_engine):
        engine.optim_step([("a", AdamParams(learning_rate=1e-2))])
    assert torch.equal(parts_engine.adapter("a").flat_weights, whole_engine.adapter("a").flat_weights)


def test_a_part_holds_whole_passes_within_its_tokens_and_one_pass_at_least(tiny_model_path):
    gen = torch.Generator().manual_seed(4)
    engine = engine_with_adapter(tiny_model_path)
    request = ForwardBackwardInput("a", [random_datum("cross_entropy", n, gen, VOCAB) for n in (30, 30, 30, 200, 30)])
    split = SplitRun.begin("r", request, engine.vocab_size, engine.max_seq_len)
    sizes = []
    while not split.complete:
        before = split.tokens_done
        split.add(engine.forward_backward([split.next_input(80, max_pass_tokens=64, min_shared=0)])[0])
        sizes.append(split.tokens_done - before)
    # passes of 64 rows: [30, 30], [30], [200] (alone, longer than a pass), [30]; parts of <= 80 tokens
    # take whole passes ([30, 30] + [30] would be 90), and the 200-token datum goes alone
    assert sizes == [60, 30, 200, 30]
    assert split.result().metrics["loss:sum"] == pytest.approx(
        engine_with_adapter(tiny_model_path).forward_backward([request])[0].metrics["loss:sum"], rel=1e-6)


def test_a_bad_datum_anywhere_fails_the_request_before_any_part_runs(tiny_model_path):
    gen = torch.Generator().manual_seed(5)
    data = [random_datum("cross_entropy", 20, gen, VOCAB) for _ in range(10)]
    data[7].loss_fn_inputs["weights"][3] = float("nan")
    engine = engine_with_adapter(tiny_model_path)
    with pytest.raises(InvalidInputError, match=r"data\[7\]\.loss_fn_inputs\['weights'\]"):
        SplitRun.begin("r", ForwardBackwardInput("a", data), engine.vocab_size, engine.max_seq_len)

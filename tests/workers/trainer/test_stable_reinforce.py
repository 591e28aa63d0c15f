"""stable_reinforce: the loss against its per-token reference, its validation, the provenance that
feeds it, and a small RL run on the tiny model whose reward improves.

The parity with peft and the batch invariance of this loss are in test_engine_parity.py and
test_engine_invariants.py, with the other losses.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from loraplex.types import AdamParams
from loraplex.wire.codec import DatumWire, ProvenanceSpanWire

from contract.configs import LoraConfig
from contract.errors import InvalidInputError
from contract.inputs import EngineDatum, ForwardBackwardInput
from contract.loss_specs import LOSS_SPECS, RECORDED_LOGPROBS, RECORDED_SEQUENCE
from db.stability import Recorded, recorded_inputs
from tests.workers.trainer.peft_reference import stable_reinforce_reference
from workers.trainer.batch import prepare_request
from workers.trainer.engine import TrainerEngine
from workers.trainer.losses import stable_reinforce

CONFIG = LOSS_SPECS["stable_reinforce"].config_defaults


def test_loss_and_gradient_match_the_per_token_reference():
    """Several datums in one call, each with its own sequences: one sampled sequence split in two runs
    around another (still one sequence), a sequence dropped for drifting, ratios above the cap."""
    gen = torch.Generator().manual_seed(0)
    datums = []
    for n in (9, 5, 12):
        sequence = torch.zeros(n)
        sequence[2:4], sequence[4:6], sequence[6:] = 1, 2, 1
        q = -3.0 + 0.8 * torch.randn(n, generator=gen)
        if n == 12:
            q[4:6] += 4.0  # sequence 2 of this datum drifted: dropped
        advantages = torch.randn(n, generator=gen) * (sequence > 0)
        datums.append({RECORDED_SEQUENCE: sequence, RECORDED_LOGPROBS: q * (sequence > 0), "advantages": advantages})
    tlp = (-3.0 + 0.8 * torch.randn(sum(len(d["advantages"]) for d in datums), generator=gen)).requires_grad_()
    config = {**CONFIG, "kl_coeff": 0.2}

    inputs = {k: torch.cat([d[k] for d in datums]) for k in datums[0]}
    lengths = [d["advantages"].numel() for d in datums]
    datum_index = torch.repeat_interleave(torch.arange(len(datums)), torch.tensor(lengths))
    ours = stable_reinforce(tlp, inputs, config, datum_index, len(datums))
    assert ours[:2].abs().sum() == 0  # prompt rows carry nothing
    (ours_grad,) = torch.autograd.grad(ours.sum(), tlp)

    reference = sum(stable_reinforce_reference(part, d, config)
                    for part, d in zip(tlp.split(lengths), datums))
    (reference_grad,) = torch.autograd.grad(reference, tlp)
    torch.testing.assert_close(ours.sum(), reference.float(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ours_grad, reference_grad.float(), rtol=1e-6, atol=1e-6)
    dropped = slice(9 + 5 + 4, 9 + 5 + 6)
    assert ours_grad[dropped].abs().sum() == 0 and ours_grad[9 + 5 + 6:].abs().sum() > 0
    weights = torch.exp(tlp.detach() - inputs[RECORDED_LOGPROBS])
    assert (weights[inputs[RECORDED_SEQUENCE] > 0] > CONFIG["clip_high_threshold"]).any()  # the cap binds somewhere


def request(loss_inputs: dict, config=None) -> ForwardBackwardInput:
    return ForwardBackwardInput("a", [EngineDatum(torch.arange(1, 5), loss_inputs)], "stable_reinforce", config)


def recorded_rows(advantages) -> dict:
    return {"target_tokens": torch.arange(2, 6), "advantages": torch.tensor(advantages),
            RECORDED_LOGPROBS: torch.tensor([0.0, -1.0, -1.0, -2.0]), RECORDED_SEQUENCE: torch.tensor([0.0, 1, 1, 1])}


@pytest.mark.parametrize("inputs, config, field", [
    # no provenance resolved: the client gets told what the loss needs
    ({"target_tokens": torch.arange(2, 6), "advantages": torch.ones(4)}, None, "data[0].loss_fn_input_spans"),
    (recorded_rows([0.5, 1.0, 1.0, 1.0]), None, "data[0].loss_fn_inputs['advantages']"),  # a prompt row with advantage
    # more sequences than rows: refused before the loss sizes anything by it
    ({**recorded_rows([0.0, 1, 1, 1]), RECORDED_SEQUENCE: torch.tensor([0.0, 1, 1, 1e9])}, None,
     f"data[0].loss_fn_inputs[{RECORDED_SEQUENCE!r}]"),
    ({**recorded_rows([0.0, 1, 1, 1]), "weights": torch.ones(4)}, None, "data[0].loss_fn_inputs['weights']"),
    (recorded_rows([0.0, 1, 1, 1]), {"clip_low_threshold": 0.5}, "loss_fn_config['clip_low_threshold']"),
    (recorded_rows([0.0, 1, 1, 1]), {"clip_high_threshold": 0.0}, "loss_fn_config['clip_high_threshold']"),
    (recorded_rows([0.0, 1, 1, 1]), {"sequence_ratio_threshold": 0.5}, "loss_fn_config['sequence_ratio_threshold']"),
    (recorded_rows([0.0, 1, 1, 1]), {"kl_coeff": -1.0}, "loss_fn_config['kl_coeff']"),
])
def test_bad_requests_name_the_field(inputs, config, field):
    with pytest.raises(InvalidInputError) as caught:
        prepare_request(0, request(inputs, config), vocab_size=512, max_len=64)
    assert caught.value.field == field


def test_a_valid_request_fills_the_client_logprobs_it_may_omit():
    prepared = prepare_request(0, request(recorded_rows([0.0, 1, 1, 1]), {"kl_coeff": 0.1}), 512, 64)
    assert prepared.config == {"clip_high_threshold": 2.0, "sequence_ratio_threshold": 2.0, "kl_coeff": 0.1}
    assert prepared.inputs[0]["logprobs"].tolist() == [0.0] * 4


# --- provenance -> the recorded inputs (db/stability.py) ----------------------------------------

PROMPT, SAMPLED = np.array([7, 8, 9]), np.array([20, 21, 22])
RECORD = {"s1": Recorded(PROMPT, SAMPLED, np.array([-0.5, -1.5, -2.5], np.float32), 3)}


def span(kind, sequence_id, length, offset=0):
    return ProvenanceSpanWire(kind, sequence_id, offset, length)


def rl_loop_datum(targets=None, model_input_spans=None) -> DatumWire:
    """As tinker-cookbook's rl_loop builds it: prompt + sampled[:-1] in, zeros then sampled out."""
    tokens = np.concatenate([PROMPT, SAMPLED[:-1]])
    targets = np.array([0, 0, 20, 21, 22]) if targets is None else targets
    return DatumWire(
        tokens, {"target_tokens": targets, "advantages": np.array([0, 0, 1, 1, 1], np.float32)},
        model_input_spans or (span("prompt", "s1", 3), span("sampled", "s1", 2)),
        (span("prompt", "s1", 2, offset=1), span("sampled", "s1", 3)),
    )


def test_rl_loop_provenance_gives_the_sampler_logprobs_on_sampled_rows():
    inputs = recorded_inputs(0, rl_loop_datum(), RECORD)
    assert inputs[RECORDED_LOGPROBS].tolist() == [0.0, 0.0, -0.5, -1.5, -2.5]
    assert inputs[RECORDED_SEQUENCE].tolist() == [0, 0, 1, 1, 1]


def test_a_multi_turn_datum_numbers_its_sequences():
    """tinker-cookbook rl/data_processing: turn 2's prompt holds turn 1 and continues at its end."""
    second = Recorded(np.array([7, 8, 9, 20, 21, 22, 30]), np.array([40, 41]), np.array([-0.1, -0.2], np.float32), 4)
    full = [7, 8, 9, 20, 21, 22, 30, 40, 41]
    datum = DatumWire(
        np.array(full[:-1]), {"target_tokens": np.array(full[1:]), "advantages": np.zeros(8, np.float32)},
        (span("prompt", "s1", 3), span("sampled", "s1", 3), span("prompt", "s2", 1, offset=6),
         span("sampled", "s2", 1)),
        (span("prompt", "s1", 2, offset=1), span("sampled", "s1", 3), span("prompt", "s2", 1, offset=6),
         span("sampled", "s2", 2)),
    )
    inputs = recorded_inputs(0, datum, {**RECORD, "s2": second})
    assert inputs[RECORDED_SEQUENCE].tolist() == [0, 0, 1, 1, 1, 0, 2, 2]
    assert inputs[RECORDED_LOGPROBS].tolist() == pytest.approx([0, 0, -0.5, -1.5, -2.5, 0, -0.1, -0.2])


@pytest.mark.parametrize("datum, field, words", [
    (rl_loop_datum(targets=np.array([0, 0, 20, 99, 22])), "data[0].loss_fn_input_spans[1]", "position 3 is token 99"),
    (rl_loop_datum(model_input_spans=(span("prompt", "s1", 3), span("sampled", "s1", 2, offset=1))),
     "data[0].model_input_spans[1]", "position 3 is token 20"),
    (rl_loop_datum(model_input_spans=(span("prompt", "s1", 2), span("sampled", "s1", 2))),
     "data[0].model_input_spans", "cover 4 positions"),
    (rl_loop_datum(model_input_spans=(span("prompt", "s1", 3), span("sampled", "gone", 2))),
     "data[0].model_input_spans[1].sequence_id", "'gone' is not a recorded sequence"),
    (rl_loop_datum(model_input_spans=(span("prompt", "s1", 4), span("sampled", "s1", 1))),
     "data[0].model_input_spans[0]", "which has 3"),
])
def test_provenance_that_does_not_match_the_record_names_the_span(datum, field, words):
    with pytest.raises(InvalidInputError) as caught:
        recorded_inputs(0, datum, RECORD)
    assert caught.value.field == field and words in caught.value.message


# --- it learns -------------------------------------------------------------------------------------


def sample(engine: TrainerEngine, prompt: list[int], group: int, length: int, gen: torch.Generator):
    """Sample `group` continuations from the adapter's own distribution, with the sampled tokens'
    logprobs: the next-token distribution is a forward pass whose targets are the whole vocabulary."""
    vocab = engine.vocab_size
    sequences = [list(prompt) for _ in range(group)]
    logprobs: list[list[float]] = [[] for _ in range(group)]
    for _ in range(length):
        data = [EngineDatum(torch.tensor(s), {"target_tokens": torch.arange(vocab).repeat(len(s), 1),
                                        "weights": torch.zeros(len(s), vocab)}) for s in sequences]
        outputs = engine.forward([ForwardBackwardInput("rl", data)])[0].loss_fn_outputs
        for s, lps, out in zip(sequences, logprobs, outputs):
            last = out["logprobs"][-1]
            token = int(torch.multinomial(last.exp(), 1, generator=gen))
            s.append(token)
            lps.append(float(last[token]))
    return [s[len(prompt):] for s in sequences], logprobs


def test_a_small_rl_run_on_the_tiny_model_raises_the_reward(tiny_model_path):
    """Reward: the share of sampled tokens with an even id. Each round samples a group, then takes two
    optimizer steps on it (the second one off-policy), through the provenance path a request takes."""
    engine = TrainerEngine(tiny_model_path)
    engine.create_adapter("rl", LoraConfig(rank=8, seed=0))
    gen = torch.Generator().manual_seed(0)
    prompt, group, length = [5, 6, 7, 8], 16, 6
    rewards = []
    for round_ in range(14):
        sampled, logprobs = sample(engine, prompt, group, length, gen)
        reward = torch.tensor([sum(t % 2 == 0 for t in s) / length for s in sampled])
        rewards.append(reward.mean().item())
        advantages = reward - reward.mean()
        data = []
        for g, (tokens, lps) in enumerate(zip(sampled, logprobs)):
            sid = f"round{round_}:{g}"
            record = {sid: Recorded(np.array(prompt), np.array(tokens), np.array(lps, np.float32), round_)}
            wire = DatumWire(
                np.array(prompt + tokens[:-1]),
                {"target_tokens": np.array([0] * (len(prompt) - 1) + tokens),
                 "advantages": np.array([0.0] * (len(prompt) - 1) + [float(advantages[g])] * length, np.float32)},
                (span("prompt", sid, len(prompt)), span("sampled", sid, length - 1)),
                (span("prompt", sid, len(prompt) - 1, offset=1), span("sampled", sid, length)),
            )
            inputs = {**wire.loss_fn_inputs, **recorded_inputs(g, wire, record)}
            data.append(EngineDatum(torch.from_numpy(wire.tokens), {k: torch.from_numpy(v) for k, v in inputs.items()}))
        for half in (data[: group // 2], data[group // 2:]):
            result = engine.forward_backward([ForwardBackwardInput("rl", half, "stable_reinforce")])[0]
            assert np.isfinite(result.metrics["loss:sum"])
            engine.optim_step([("rl", AdamParams(learning_rate=2e-2))])
    first, last = np.mean(rewards[:3]), np.mean(rewards[-3:])
    assert last > first + 0.2, rewards

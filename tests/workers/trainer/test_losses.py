"""Each built-in loss on a few hand-picked tokens: its per-token values and its gradient with respect
to the target logprobs, against the formula written out (docs/losses.md). Pure torch, no model.

Ratios are chosen as round numbers (tlp = log_old + log(r)), so the expected values can be read
off the formulas by hand; a case on each side of every clip bound."""

from __future__ import annotations

import math

import pytest
import torch

from contract.loss_specs import LOSS_SPECS, RECORDED_LOGPROBS, RECORDED_SEQUENCE
from workers.trainer.losses import LOSS_FUNCTIONS

TESTED = {"cross_entropy", "importance_sampling", "ppo", "cispo", "dro", "gspo", "stable_reinforce"}


def t(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


def run(name: str, tlp, inputs: dict, datum_index=None, config: dict | None = None):
    """The loss's per-token values and d(sum of them)/d(tlp), with the table's default config."""
    tlp = t(tlp).requires_grad_()
    inputs = {k: t(v) for k, v in inputs.items()}
    datum_index = torch.zeros(tlp.shape[0], dtype=torch.long) if datum_index is None else torch.tensor(datum_index)
    config = LOSS_SPECS[name].config_defaults | (config or {})
    loss = LOSS_FUNCTIONS[name](tlp, inputs, config, datum_index, int(datum_index.max()) + 1)
    loss.sum().backward()
    return loss.detach(), tlp.grad


def test_every_loss_in_the_table_has_a_unit_test_here():
    assert set(LOSS_SPECS) == set(LOSS_FUNCTIONS) == TESTED


def test_cross_entropy_is_minus_the_weighted_logprob():
    tlp, w = [-0.5, -2.0, -1.0], [1.0, 0.0, 2.0]
    loss, grad = run("cross_entropy", tlp, {"weights": w})
    assert torch.equal(loss, t([0.5, 0.0, 2.0]))
    assert torch.equal(grad, t([-1.0, 0.0, -2.0]))  # d(-w * tlp) = -w


def test_cross_entropy_with_several_targets_per_position():
    tlp, w = [[-1.0, -2.0], [-3.0, -0.5]], [[0.5, 0.5], [1.0, 0.0]]
    loss, grad = run("cross_entropy", tlp, {"weights": w})
    assert torch.equal(loss, t([[0.5, 1.0], [3.0, 0.0]]))
    assert torch.equal(grad, -t(w))


def test_importance_sampling_is_minus_ratio_times_advantage():
    old = [-1.0, -2.0, -0.3]
    ratio, adv = [2.0, 0.5, 1.0], [1.0, -2.0, 3.0]
    tlp = [o + math.log(r) for o, r in zip(old, ratio)]
    loss, grad = run("importance_sampling", tlp, {"logprobs": old, "advantages": adv})
    # loss = -r A; d/dtlp = -r A (dr/dtlp = r)
    assert torch.allclose(loss, t([-2.0, 1.0, -3.0]))
    assert torch.allclose(grad, t([-2.0, 1.0, -3.0]))


def test_ppo_takes_the_pessimistic_of_the_clipped_and_unclipped_terms():
    # default clip range [0.8, 1.2]
    ratio = [1.5, 1.5, 0.5, 0.5, 1.0]
    adv = [1.0, -1.0, 1.0, -1.0, 2.0]
    old = [-1.0] * 5
    tlp = [o + math.log(r) for o, r in zip(old, ratio)]
    loss, grad = run("ppo", tlp, {"logprobs": old, "advantages": adv})
    # -min(rA, clip(r)A):  1.5 vs 1.2 -> clipped;  -1.5 vs -1.2 -> unclipped;  0.5 vs 0.8 -> unclipped;
    # -0.5 vs -0.8 -> clipped;  r = 1 inside the range: both are 2
    assert torch.allclose(loss, t([-1.2, 1.5, -0.5, 0.8, -2.0]))
    # a clipped token has no gradient; an unclipped one has -r A
    assert torch.allclose(grad, t([0.0, 1.5, -0.5, 0.0, -2.0]))


def test_ppo_clip_bounds_come_from_the_config():
    loss, grad = run("ppo", [math.log(1.5)], {"logprobs": [0.0], "advantages": [1.0]},
                     config={"clip_high_threshold": 2.0})
    assert torch.allclose(loss, t([-1.5])) and torch.allclose(grad, t([-1.5]))


def test_cispo_weights_the_logprob_by_the_clipped_ratio_without_its_gradient():
    # default clip range [0, 4]
    ratio, adv = [5.0, 2.0, 0.5], [1.0, -1.0, 2.0]
    old = [-0.7, -1.0, -2.0]
    tlp = [o + math.log(r) for o, r in zip(old, ratio)]
    loss, grad = run("cispo", tlp, {"logprobs": old, "advantages": adv})
    clipped = t([4.0, 2.0, 0.5])
    assert torch.allclose(loss, -clipped * t(tlp) * t(adv))
    assert torch.allclose(grad, -clipped * t(adv))  # the ratio is a constant weight: d = -sg(clip(r)) A


def test_dro_is_the_policy_gradient_minus_a_quadratic_penalty():
    tlp, old, adv = [-1.0, -0.5, -2.0], [-1.5, -0.5, -1.0], [2.0, 1.0, -1.0]
    loss, grad = run("dro", tlp, {"logprobs": old, "advantages": adv})
    beta = 0.05
    # loss = -(tlp A - beta/2 (tlp - old)^2); d/dtlp = -A + beta (tlp - old)
    assert torch.allclose(loss, t([2.0 + 0.025 * 0.25, 0.5, -2.0 + 0.025 * 1.0]))
    assert torch.allclose(grad, t([-2.0 + beta * 0.5, -1.0, 1.0 + beta * -1.0]))


def test_gspo_gives_each_token_its_sequences_ratio_with_its_own_gradient():
    # datum 0: three tokens, the middle one masked out; datum 1: an empty mask (ratio 1)
    old = [-1.0, -1.0, -1.0, -2.0, -2.0]
    log_ratio = [math.log(2.0), 5.0, math.log(0.5) + math.log(1.21), 0.3, -0.3]
    tlp = [o + d for o, d in zip(old, log_ratio)]
    mask, adv = [1.0, 0.0, 1.0, 0.0, 0.0], [-1.0, -1.0, -1.0, 1.0, 1.0]
    loss, grad = run("gspo", tlp, {"logprobs": old, "advantages": adv, "sequence_ratio_mask": mask},
                     datum_index=[0, 0, 0, 1, 1])
    # datum 0's ratio: exp(mean(log 2, log 0.605)) = sqrt(1.21) = 1.1, inside [0.8, 1.2]: loss -rA = 1.1
    # per token, gradient d(r)/d(tlp_t) = r (each token's own logprob, masked or not)
    # datum 1's ratio is 1: loss -A = -1, gradient -A = -1
    assert torch.allclose(loss, t([1.1, 1.1, 1.1, -1.0, -1.0]))
    assert torch.allclose(grad, t([1.1, 1.1, 1.1, -1.0, -1.0]))


def test_gspo_clips_the_sequence_ratio():
    old, log_ratio = [0.0, 0.0], [math.log(2.0), math.log(2.0)]
    loss, grad = run("gspo", log_ratio, {"logprobs": old, "advantages": [1.0, 1.0], "sequence_ratio_mask": [1.0, 1.0]})
    assert torch.allclose(loss, t([-1.2, -1.2]))  # -min(2 A, 1.2 A)
    assert torch.equal(grad, t([0.0, 0.0]))


def test_stable_reinforce_truncates_weights_drops_drifted_sequences_and_skips_prompt_rows():
    # one datum: a prompt row (sequence 0), sequence 1 (kept: mean drift log(1.5) <= log 2),
    # sequence 2 (dropped: mean drift log 3 > log 2)
    q = [0.0, -1.0, -1.0, -2.0, -2.0]
    d = [0.0, math.log(3.0), math.log(0.75), math.log(3.0), math.log(3.0)]
    tlp = [a + b for a, b in zip(q, d)]
    seq, adv = [0.0, 1.0, 1.0, 2.0, 2.0], [0.0, 2.0, 2.0, 1.0, 1.0]
    inputs = {"advantages": adv, "logprobs": [0.0] * 5, RECORDED_LOGPROBS: q, RECORDED_SEQUENCE: seq}
    loss, grad = run("stable_reinforce", tlp, inputs)
    # kept rows: -min(exp(d), 2) A tlp, gradient -min(exp(d), 2) A (the weight carries no gradient)
    w = t([0.0, 2.0, 0.75, 0.0, 0.0])
    assert torch.allclose(loss, -w * t(adv) * t(tlp))
    assert torch.allclose(grad, -w * t(adv))


def test_stable_reinforce_kl_penalty_and_sequences_of_different_datums_apart():
    # the same sequence number in two datums is two sequences: datum 1's drift does not drop datum 0's
    q = [-1.0, -1.0, -1.0, -1.0]
    d = [math.log(1.5), math.log(1.5), math.log(4.0), math.log(4.0)]
    tlp = [a + b for a, b in zip(q, d)]
    inputs = {"advantages": [1.0, -1.0, 1.0, 1.0], "logprobs": [0.0] * 4, RECORDED_LOGPROBS: q,
              RECORDED_SEQUENCE: [1.0, 1.0, 1.0, 1.0]}
    kl = 0.1
    loss, grad = run("stable_reinforce", tlp, inputs, datum_index=[0, 0, 1, 1], config={"kl_coeff": kl})
    # datum 0 kept: -1.5 A tlp + kl/2 d^2, gradient -1.5 A + kl d; datum 1 dropped (drift log 4 > log 2)
    d0, adv0, tlp0 = t(d[:2]), t([1.0, -1.0]), t(tlp[:2])
    assert torch.allclose(loss, torch.cat([-1.5 * adv0 * tlp0 + kl / 2 * d0**2, t([0.0, 0.0])]))
    assert torch.allclose(grad, torch.cat([-1.5 * adv0 + kl * d0, t([0.0, 0.0])]))


@pytest.mark.parametrize("name", sorted(TESTED - {"cross_entropy"}))
def test_a_policy_equal_to_the_sampler_gives_minus_the_advantage_as_gradient(name):
    """At ratio 1 (and no drift) every RL loss's gradient is the plain policy gradient -A, except DRO's
    quadratic, which vanishes there too."""
    old, adv = [-1.0, -0.5, -3.0], [0.5, -2.0, 1.0]
    inputs = {"logprobs": old, "advantages": adv}
    if name == "gspo":
        inputs["sequence_ratio_mask"] = [1.0, 1.0, 1.0]
    if name == "stable_reinforce":
        inputs |= {RECORDED_LOGPROBS: old, RECORDED_SEQUENCE: [1.0, 1.0, 1.0]}
    _, grad = run(name, old, inputs)
    assert torch.allclose(grad, -t(adv))

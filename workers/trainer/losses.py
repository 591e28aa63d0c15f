"""Built-in losses with Tinker's semantics: per-token losses SUMMED over tokens and datums.

Each loss is a pure function over one request's tokens, concatenated across its datums:
    target_logprobs  [n] or [n, K]   log p(target_tokens) under the current weights
    inputs           loss_fn_inputs concatenated along the token axis
    config           loss_fn_config with defaults filled in
    datum_index      [n] which datum each token belongs to (for per-sequence terms, e.g. GSPO)
It returns the per-token loss; the request's loss is its sum (never a mean). docs/losses.md has
the math of stable_reinforce, the one loss whose inputs the server completes (from what the
sampler recorded).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import math

import torch
from torch import Tensor

from workers.trainer.errors import InvalidInputError

LossFn = Callable[[Tensor, dict[str, Tensor], dict[str, float], Tensor, int], Tensor]


def cross_entropy(tlp: Tensor, inputs: dict[str, Tensor], config: dict[str, float], datum_index: Tensor, n: int):
    return -tlp * inputs["weights"]


def _ratio(tlp: Tensor, inputs: dict[str, Tensor]) -> Tensor:
    return torch.exp(tlp - inputs["logprobs"])


def importance_sampling(tlp, inputs, config, datum_index, n):
    return -_ratio(tlp, inputs) * inputs["advantages"]


def ppo(tlp, inputs, config, datum_index, n):
    ratio = _ratio(tlp, inputs)
    clipped = ratio.clamp(config["clip_low_threshold"], config["clip_high_threshold"])
    adv = inputs["advantages"]
    return -torch.minimum(ratio * adv, clipped * adv)


def cispo(tlp, inputs, config, datum_index, n):
    clipped = _ratio(tlp, inputs).clamp(config["clip_low_threshold"], config["clip_high_threshold"])
    return -(clipped.detach() * tlp * inputs["advantages"])


def dro(tlp, inputs, config, datum_index, n):
    quad = (tlp - inputs["logprobs"]) ** 2
    return -(tlp * inputs["advantages"] - 0.5 * config["beta"] * quad)


def gspo(tlp, inputs, config, datum_index, n):
    """GSPO-token: every token carries its sequence's ratio value with its own token's gradient."""
    mask = (inputs["sequence_ratio_mask"] != 0).to(tlp.dtype)
    log_ratio_tok = (tlp.detach() - inputs["logprobs"]) * mask
    sums = torch.zeros(n, dtype=tlp.dtype, device=tlp.device).index_add_(0, datum_index, log_ratio_tok)
    counts = torch.zeros(n, dtype=tlp.dtype, device=tlp.device).index_add_(0, datum_index, mask)
    seq_log_ratio = sums / counts.clamp(min=1)  # a sequence with an empty mask gets ratio 1
    ratio = torch.exp(seq_log_ratio[datum_index] + tlp - tlp.detach())
    clipped = ratio.clamp(config["clip_low_threshold"], config["clip_high_threshold"])
    adv = inputs["advantages"]
    return -torch.minimum(ratio * adv, clipped * adv)


# Inputs of stable_reinforce that the server fills in from a datum's provenance spans and what the
# sampler recorded (scheduler/stability.py); a client never sends them.
RECORDED_LOGPROBS = "recorded_logprobs"  # per row: the sampler's logprob of the target; 0 off sampled rows
RECORDED_SEQUENCE = "recorded_sequence"  # per row: k >= 1 for the datum's k-th sampled sequence; 0 off sampled rows


def stable_reinforce(tlp, inputs, config, datum_index, n):
    """REINFORCE on recorded samples with truncated importance weights, sequences that drifted too
    far dropped, and an optional squared-log-ratio penalty (docs/losses.md has the math):
        d_t = sg(tlp_t) - q_t on sampled rows, q_t the sampler's recorded logprob
        keep_t = |mean of d over t's sequence in the datum| <= log(sequence_ratio_threshold)
        loss_t = keep_t * (-sg(min(exp(d_t), clip_high_threshold)) * A_t * tlp_t + kl_coeff/2 * (tlp_t - q_t)^2)
    Rows that no sampled sequence backs (prompt rows) have no loss."""
    seq = inputs[RECORDED_SEQUENCE].long()
    sampled = seq > 0
    q = inputs[RECORDED_LOGPROBS]
    log_ratio = torch.where(sampled, tlp.detach() - q, torch.zeros_like(q))
    # one bucket per (datum, sequence): a datum's sequences do not see the rest of the batch
    pairs, bucket = torch.unique(torch.stack([datum_index, seq]), dim=1, return_inverse=True)
    sums = torch.zeros(pairs.shape[1], dtype=tlp.dtype, device=tlp.device).index_add_(0, bucket, log_ratio)
    counts = torch.zeros(pairs.shape[1], dtype=tlp.dtype, device=tlp.device).index_add_(0, bucket, sampled.to(tlp.dtype))
    drift = (sums / counts.clamp(min=1))[bucket]
    keep = sampled & (drift.abs() <= math.log(config["sequence_ratio_threshold"]))
    weight = torch.exp(log_ratio).clamp(max=config["clip_high_threshold"])  # no gradient: log_ratio is detached
    token_loss = -weight * inputs["advantages"] * tlp
    if config["kl_coeff"]:
        token_loss = token_loss + 0.5 * config["kl_coeff"] * (tlp - q) ** 2
    # where, not a product: a dropped row's terms may be inf, and inf * 0 is NaN
    return torch.where(keep, token_loss, torch.zeros_like(token_loss))


def _check_stable_reinforce_config(config: dict[str, float]) -> None:
    if config["clip_high_threshold"] <= 0:
        raise InvalidInputError("loss_fn_config['clip_high_threshold']",
                                "must be > 0 (the cap on a token's importance weight)")
    if config["sequence_ratio_threshold"] < 1:
        raise InvalidInputError("loss_fn_config['sequence_ratio_threshold']",
                                "must be >= 1 (sequences whose mean ratio leaves [1/t, t] are dropped)")
    if config["kl_coeff"] < 0:
        raise InvalidInputError("loss_fn_config['kl_coeff']", "must be >= 0")


def _check_stable_reinforce_datum(i: int, inputs: dict[str, Tensor]) -> None:
    seq = inputs[RECORDED_SEQUENCE]
    if (seq < 0).any() or (seq > seq.numel()).any() or (seq != seq.round()).any():
        raise InvalidInputError(f"data[{i}].loss_fn_inputs[{RECORDED_SEQUENCE!r}]",
                                f"must hold whole sequence numbers in [0, {seq.numel()}]")
    unsampled = (seq == 0) & (inputs["advantages"] != 0)
    if unsampled.any():
        p = int(unsampled.nonzero()[0, 0])
        raise InvalidInputError(
            f"data[{i}].loss_fn_inputs['advantages']",
            f"position {p} has advantage {float(inputs['advantages'][p]):g} but no sampled token: its loss row is not "
            "in a SampledProvenanceSpan; stable_reinforce trains sampled tokens only (give prompt rows advantage 0)")


@dataclass(frozen=True)
class LossSpec:
    fn: LossFn
    required_inputs: tuple[str, ...]
    optional_inputs: dict[str, float] = field(default_factory=dict)  # name -> fill value when absent
    config_defaults: dict[str, float] = field(default_factory=dict)
    multi_target: bool = False  # accepts (N, K) target_tokens
    server_inputs: tuple[str, ...] = ()  # filled in by the server from the datum's provenance
    check_config: Callable[[dict[str, float]], None] | None = None  # raises InvalidInputError
    check_datum: Callable[[int, dict[str, Tensor]], None] | None = None  # (datum index, its inputs)


_RL_INPUTS = ("target_tokens", "logprobs", "advantages")

LOSSES: dict[str, LossSpec] = {
    "cross_entropy": LossSpec(cross_entropy, ("target_tokens",), {"weights": 1.0}, multi_target=True),
    "importance_sampling": LossSpec(importance_sampling, _RL_INPUTS),
    "ppo": LossSpec(ppo, _RL_INPUTS, config_defaults={"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}),
    "cispo": LossSpec(cispo, _RL_INPUTS, config_defaults={"clip_low_threshold": 0.0, "clip_high_threshold": 4.0}),
    # Tinker documents beta only by an example (0.05); we use it as the default.
    "dro": LossSpec(dro, _RL_INPUTS, config_defaults={"beta": 0.05}),
    # Tinker leaves GSPO's bounds undocumented ("PPO-like"); we default to PPO's.
    "gspo": LossSpec(
        gspo,
        _RL_INPUTS + ("sequence_ratio_mask",),
        config_defaults={"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
    ),
    # Tinker publishes the contract (recorded samples named by sequence_id, kl_coeff) but not the
    # objective; ours and its defaults are in docs/losses.md. The client's `logprobs` are accepted
    # and not used: the sampler's own record is what the ratios are taken against.
    "stable_reinforce": LossSpec(
        stable_reinforce,
        ("target_tokens", "advantages"),
        {"logprobs": 0.0},
        config_defaults={"clip_high_threshold": 2.0, "sequence_ratio_threshold": 2.0, "kl_coeff": 0.0},
        server_inputs=(RECORDED_LOGPROBS, RECORDED_SEQUENCE),
        check_config=_check_stable_reinforce_config,
        check_datum=_check_stable_reinforce_datum,
    ),
}

FLOAT_INPUTS = ("weights", "logprobs", "advantages", "sequence_ratio_mask", RECORDED_LOGPROBS, RECORDED_SEQUENCE)

"""Built-in losses with Tinker's semantics: per-token losses SUMMED over tokens and datums.

Each loss is a pure function over one request's tokens, concatenated across its datums:
    target_logprobs  [n] or [n, K]   log p(target_tokens) under the current weights
    inputs           loss_fn_inputs concatenated along the token axis
    config           loss_fn_config with defaults filled in
    datum_index      [n] which datum each token belongs to (for per-sequence terms, e.g. GSPO)
It returns the per-token loss; the request's loss is its sum (never a mean). docs/losses.md has
the math of stable_reinforce, the one loss whose inputs the server completes (from what the
sampler recorded). What each loss takes (inputs, config, checks) is in loss_specs.py, without torch.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
from torch import Tensor

from contract.loss_specs import LOSS_SPECS, RECORDED_LOGPROBS, RECORDED_SEQUENCE

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


LOSS_FUNCTIONS: dict[str, LossFn] = {
    "cross_entropy": cross_entropy,
    "importance_sampling": importance_sampling,
    "ppo": ppo,
    "cispo": cispo,
    "dro": dro,
    "gspo": gspo,
    "stable_reinforce": stable_reinforce,
}
assert LOSS_FUNCTIONS.keys() == LOSS_SPECS.keys(), "every loss needs its spec and its function"

"""Built-in losses with Tinker's semantics: per-token losses SUMMED over tokens and datums.

Each loss is a pure function over one request's tokens, concatenated across its datums:
    target_logprobs  [n] or [n, K]   log p(target_tokens) under the current weights
    inputs           loss_fn_inputs concatenated along the token axis
    config           loss_fn_config with defaults filled in
    datum_index      [n] which datum each token belongs to (for per-sequence terms, e.g. GSPO)
It returns the per-token loss; the request's loss is its sum (never a mean).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import Tensor

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


@dataclass(frozen=True)
class LossSpec:
    fn: LossFn
    required_inputs: tuple[str, ...]
    optional_inputs: dict[str, float] = field(default_factory=dict)  # name -> fill value when absent
    config_defaults: dict[str, float] = field(default_factory=dict)
    multi_target: bool = False  # accepts (N, K) target_tokens


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
}

FLOAT_INPUTS = ("weights", "logprobs", "advantages", "sequence_ratio_mask")

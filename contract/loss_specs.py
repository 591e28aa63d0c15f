"""What each built-in loss takes: its inputs, its config and their checks (the functions are losses.py's).

No torch here: the API checks a request against these specs at the door (contract/inputs.py)
with the same code the engine runs, and the checks work on numpy arrays.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from contract.errors import InvalidInputError

# Inputs of stable_reinforce that the server fills in from a datum's provenance spans and what the
# sampler recorded (db/stability.py); a client never sends them.
RECORDED_LOGPROBS = "recorded_logprobs"  # per row: the sampler's logprob of the target; 0 off sampled rows
RECORDED_SEQUENCE = "recorded_sequence"  # per row: k >= 1 for the datum's k-th sampled sequence; 0 off sampled rows


def _check_stable_reinforce_config(config: dict[str, float]) -> None:
    if config["clip_high_threshold"] <= 0:
        raise InvalidInputError("loss_fn_config['clip_high_threshold']",
                                "must be > 0 (the cap on a token's importance weight)")
    if config["sequence_ratio_threshold"] < 1:
        raise InvalidInputError("loss_fn_config['sequence_ratio_threshold']",
                                "must be >= 1 (sequences whose mean ratio leaves [1/t, t] are dropped)")
    if config["kl_coeff"] < 0:
        raise InvalidInputError("loss_fn_config['kl_coeff']", "must be >= 0")


def _check_stable_reinforce_datum(i: int, inputs: dict[str, np.ndarray]) -> None:
    seq = inputs[RECORDED_SEQUENCE]
    if (seq < 0).any() or (seq > seq.size).any() or (seq != np.round(seq)).any():
        raise InvalidInputError(f"data[{i}].loss_fn_inputs[{RECORDED_SEQUENCE!r}]",
                                f"must hold whole sequence numbers in [0, {seq.size}]")
    unsampled = (seq == 0) & (inputs["advantages"] != 0)
    if unsampled.any():
        p = int(np.flatnonzero(unsampled)[0])
        raise InvalidInputError(
            f"data[{i}].loss_fn_inputs['advantages']",
            f"position {p} has advantage {float(inputs['advantages'][p]):g} but no sampled token: its loss row is not "
            "in a SampledProvenanceSpan; stable_reinforce trains sampled tokens only (give prompt rows advantage 0)")


@dataclass(frozen=True)
class LossSpec:
    required_inputs: tuple[str, ...]
    optional_inputs: dict[str, float] = field(default_factory=dict)  # name -> fill value when absent
    config_defaults: dict[str, float] = field(default_factory=dict)
    multi_target: bool = False  # accepts (N, K) target_tokens
    server_inputs: tuple[str, ...] = ()  # filled in by the server from the datum's provenance
    check_config: Callable[[dict[str, float]], None] | None = None  # raises InvalidInputError
    check_datum: Callable[[int, dict[str, np.ndarray]], None] | None = None  # (datum index, its inputs)


_RL_INPUTS = ("target_tokens", "logprobs", "advantages")

LOSS_SPECS: dict[str, LossSpec] = {
    "cross_entropy": LossSpec(("target_tokens",), {"weights": 1.0}, multi_target=True),
    "importance_sampling": LossSpec(_RL_INPUTS),
    "ppo": LossSpec(_RL_INPUTS, config_defaults={"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}),
    "cispo": LossSpec(_RL_INPUTS, config_defaults={"clip_low_threshold": 0.0, "clip_high_threshold": 4.0}),
    # Tinker documents beta only by an example (0.05); we use it as the default.
    "dro": LossSpec(_RL_INPUTS, config_defaults={"beta": 0.05}),
    # Tinker leaves GSPO's bounds undocumented ("PPO-like"); we default to PPO's.
    "gspo": LossSpec(_RL_INPUTS + ("sequence_ratio_mask",),
                     config_defaults={"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}),
    # Tinker publishes the contract (recorded samples named by sequence_id, kl_coeff) but not the
    # objective; ours and its defaults are in docs/losses.md. The client's `logprobs` are accepted
    # and not used: the sampler's own record is what the ratios are taken against.
    "stable_reinforce": LossSpec(
        ("target_tokens", "advantages"),
        {"logprobs": 0.0},
        config_defaults={"clip_high_threshold": 2.0, "sequence_ratio_threshold": 2.0, "kl_coeff": 0.0},
        server_inputs=(RECORDED_LOGPROBS, RECORDED_SEQUENCE),
        check_config=_check_stable_reinforce_config,
        check_datum=_check_stable_reinforce_datum,
    ),
}

FLOAT_INPUTS = ("weights", "logprobs", "advantages", "sequence_ratio_mask", RECORDED_LOGPROBS, RECORDED_SEQUENCE)

"""What the trainer engine takes, made from the wire and checked: ForwardBackwardInput and its datums.

No torch here: the API checks each forward/forward_backward at the door with `check_request`
(errors name the field) and the engine runs the same checks again before it turns the arrays into
tensors (batch.prepare_request), so there is one definition of every check.

Datum alignment follows Tinker: every loss_fn_inputs array has leading dim N = len(tokens), and
position i of the input predicts target_tokens[i].
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from loraplex.wire.codec import ForwardBackwardWire

from contract.errors import InvalidInputError
from contract.loss_specs import FLOAT_INPUTS, LOSS_SPECS, LossSpec

ArrayLike = Any  # a numpy array, a torch tensor (any device) or a (nested) list of numbers


@dataclass
class EngineDatum:
    """One datum as the engine takes it: token ids and loss inputs as arrays. (Not the SDK's
    `loraplex.types.Datum`, which holds a ModelInput, nor the decoded wire's `DatumWire`.)"""

    tokens: ArrayLike  # the model input, token ids
    loss_fn_inputs: dict[str, ArrayLike] = field(default_factory=dict)


@dataclass
class ForwardBackwardInput:
    """One request: datums of one adapter with one loss. `forward_only` computes outputs, no gradient."""

    adapter_id: str
    data: list[EngineDatum]
    loss_fn: str = "cross_entropy"
    loss_fn_config: dict[str, float | str] | None = None
    forward_only: bool = False
    # Its datums take engine passes of their own, cut as if it ran alone: a part of a request run in
    # parts (workers/trainer/parts.py) then gets the bits the whole request gets alone.
    own_passes: bool = False


def from_wire(wire: ForwardBackwardWire) -> ForwardBackwardInput:
    """The engine's input for a decoded forward/forward_backward request (the API checks it, an
    executor runs it)."""
    return ForwardBackwardInput(
        adapter_id=wire.model_id,
        data=[EngineDatum(d.tokens, dict(d.loss_fn_inputs)) for d in wire.data],
        loss_fn=wire.loss_fn,
        loss_fn_config=dict(wire.loss_fn_config),
        forward_only=wire.forward_only,
    )


@dataclass
class CheckedRequest:
    """A request that passed every check: arrays converted, defaults filled."""

    spec: LossSpec
    tokens: list[np.ndarray]  # int64 [N_d] per datum
    inputs: list[dict[str, np.ndarray]]  # per datum, every input the loss reads (float32; targets int64)
    config: dict[str, float]


def check_request(request: ForwardBackwardInput, vocab_size: int, max_len: int) -> CheckedRequest:
    """Check one request completely (no state is touched); raise InvalidInputError naming the field."""
    spec = LOSS_SPECS.get(request.loss_fn)
    if spec is None:
        raise InvalidInputError("loss_fn", f"unknown loss {request.loss_fn!r}; known: {sorted(LOSS_SPECS)}")
    if not request.data:
        raise InvalidInputError("data", "must contain at least one datum")
    config = _check_config(request.loss_fn, spec, request.loss_fn_config)
    tokens, inputs = [], []
    for i, datum in enumerate(request.data):
        t, inp = _check_datum(i, datum, request.loss_fn, spec, vocab_size, max_len)
        tokens.append(t)
        inputs.append(inp)
    return CheckedRequest(spec, tokens, inputs, config)


def _as_array(value: ArrayLike, where: str) -> np.ndarray:
    try:
        if type(value).__module__.startswith("torch"):  # a tensor, told apart without importing torch
            value = value.detach().cpu()
            if str(value.dtype) == "torch.bfloat16":  # numpy has no bfloat16; float32 holds it exactly
                value = value.float()
        array = np.asarray(value)
    except (TypeError, ValueError, RuntimeError) as e:
        raise InvalidInputError(where, f"not a numeric array ({e})") from None
    if array.dtype.kind not in "biufc":
        raise InvalidInputError(where, f"not a numeric array (dtype {array.dtype})")
    return array


def _token_ids(value: ArrayLike, where: str, vocab_size: int) -> np.ndarray:
    t = _as_array(value, where)
    if t.dtype.kind not in "iu":
        raise InvalidInputError(where, f"token ids must be integers, got dtype {t.dtype}")
    t = t.astype(np.int64, copy=False)
    if t.size and (int(t.min()) < 0 or int(t.max()) >= vocab_size):
        bad = int(t[(t < 0) | (t >= vocab_size)][0])
        raise InvalidInputError(where, f"token id {bad} is outside the vocabulary [0, {vocab_size})")
    return t


def _check_config(loss_fn: str, spec: LossSpec, config: dict[str, Any] | None) -> dict[str, float]:
    merged = dict(spec.config_defaults)
    for key, value in (config or {}).items():
        where = f"loss_fn_config[{key!r}]"
        if key not in spec.config_defaults:
            known = sorted(spec.config_defaults) or "none"
            raise InvalidInputError(where, f"not a setting of {loss_fn} (settings: {known})")
        if isinstance(value, str):
            try:
                value = float(value)
            except ValueError:
                raise InvalidInputError(where, f"must be a number, got {value!r}") from None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise InvalidInputError(where, f"must be a finite number, got {value!r}")
        merged[key] = float(value)
    if "clip_low_threshold" in merged and merged["clip_low_threshold"] > merged["clip_high_threshold"]:
        raise InvalidInputError("loss_fn_config", "clip_low_threshold must not exceed clip_high_threshold")
    if spec.check_config is not None:
        spec.check_config(merged)
    return merged


def _check_datum(i: int, datum: EngineDatum, loss_fn: str, spec: LossSpec, vocab_size: int,
                 max_len: int) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    tokens = _token_ids(datum.tokens, f"data[{i}].model_input", vocab_size)
    if tokens.ndim != 1 or tokens.size == 0:
        raise InvalidInputError(f"data[{i}].model_input", f"must be a non-empty list of tokens, got shape {tuple(tokens.shape)}")
    n = tokens.size
    if n > max_len:
        raise InvalidInputError(f"data[{i}].model_input", f"{n} tokens exceed the model's context of {max_len}")

    allowed = set(spec.required_inputs) | set(spec.optional_inputs)
    for key in datum.loss_fn_inputs:
        if key not in allowed | set(spec.server_inputs):
            raise InvalidInputError(f"data[{i}].loss_fn_inputs[{key!r}]", f"not an input of {loss_fn} (inputs: {sorted(allowed)})")
    for key in spec.required_inputs:
        if key not in datum.loss_fn_inputs:
            raise InvalidInputError(f"data[{i}].loss_fn_inputs[{key!r}]", f"required by {loss_fn} but missing")
    if any(key not in datum.loss_fn_inputs for key in spec.server_inputs):  # the server resolves provenance first
        raise InvalidInputError(
            f"data[{i}].loss_fn_input_spans", f"{loss_fn} needs provenance: sample with record_stability_info=True "
            "and name each row's sampled sequence (Datum.with_provenance)")
    allowed |= set(spec.server_inputs)

    where = f"data[{i}].loss_fn_inputs['target_tokens']"
    targets = _token_ids(datum.loss_fn_inputs["target_tokens"], where, vocab_size)
    allowed_dims = (1, 2) if spec.multi_target else (1,)
    if targets.ndim not in allowed_dims or targets.shape[0] != n or (targets.ndim == 2 and targets.shape[1] == 0):
        expected = f"({n},) or ({n}, K)" if spec.multi_target else f"({n},)"
        raise InvalidInputError(where, f"shape {tuple(targets.shape)} does not match the model input: expected {expected}")

    inputs = {"target_tokens": targets}
    for key in FLOAT_INPUTS:
        if key not in allowed:
            continue
        where = f"data[{i}].loss_fn_inputs[{key!r}]"
        if key in datum.loss_fn_inputs:
            t = _as_array(datum.loss_fn_inputs[key], where)
            if not (t.dtype.kind == "f" or t.dtype in (np.int32, np.int64, np.bool_)):
                raise InvalidInputError(where, f"must be numbers, got dtype {t.dtype}")
            t = t.astype(np.float32, copy=False)
            if t.shape != targets.shape:
                raise InvalidInputError(where, f"shape {tuple(t.shape)} does not match target_tokens {tuple(targets.shape)}")
            if not np.isfinite(t).all():
                raise InvalidInputError(where, "contains NaN or infinity")
        else:
            t = np.full(targets.shape, spec.optional_inputs[key], dtype=np.float32)
        inputs[key] = t
    if spec.check_datum is not None:
        spec.check_datum(i, inputs)
    return tokens, inputs

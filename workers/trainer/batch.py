"""Engine-level request types, their validation, and packing many requests into one sequence.

Datum alignment follows Tinker: every loss_fn_inputs tensor has leading dim N = len(tokens),
and position i of the input predicts target_tokens[i].
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Sequence

import numpy as np
import torch
from torch import Tensor

from workers.trainer.errors import InvalidInputError
from workers.trainer.losses import FLOAT_INPUTS, LOSSES, LossSpec
from workers.trainer.packed_attention import AttentionLayout
from workers.trainer.shared_prefix import group_mask, share_plan, shared_length

TensorLike = Tensor | np.ndarray | Sequence[Any]


@dataclass
class Datum:
    tokens: TensorLike  # the model input, token ids
    loss_fn_inputs: dict[str, TensorLike] = field(default_factory=dict)


@dataclass
class ForwardBackwardInput:
    """One request: datums of one adapter with one loss. `forward_only` computes outputs, no gradient."""

    adapter_id: str
    data: list[Datum]
    loss_fn: str = "cross_entropy"
    loss_fn_config: dict[str, float] | None = None
    forward_only: bool = False
    # Its datums take engine passes of their own, cut as if it ran alone: a part of a request run in
    # parts (workers/trainer/parts.py) then gets the bits the whole request gets alone.
    own_passes: bool = False


@dataclass
class ForwardBackwardOutput:
    loss_fn_outputs: list[dict[str, Tensor]]  # per datum, e.g. {"logprobs": float32 [N] or [N, K]}
    metrics: dict[str, float]  # "name:reduction", e.g. "loss:sum"
    # each engine pass's metrics of this request and its datums there, in order: `metrics` is their
    # merge, and parts of a request merge the same way (workers/trainer/parts.py)
    pass_metrics: list[tuple[dict[str, float], int]] = field(default_factory=list)


@dataclass
class PreparedRequest:
    """A validated request: tensors converted, defaults filled."""

    index: int  # position in the caller's list
    request: ForwardBackwardInput
    spec: LossSpec
    tokens: list[Tensor]  # int64 [N_d] per datum
    inputs: list[dict[str, Tensor]]  # per datum, every input the loss reads
    config: dict[str, float]
    datum_ids: list[int] | None = None  # in a piece of a split request: which of its datums these are


def split_into_passes(requests: list[PreparedRequest], max_tokens: int,
                      min_shared: int = 0) -> list[list[PreparedRequest]]:
    """Cut a batch into passes of at most `max_tokens` packed rows, at datum boundaries (a longer
    datum gets a pass of its own). A datum that shares its first rows with its group's leader in
    the same pass costs only its own rows (`shared_prefix`, as `pack` lays them out). Losses are
    sums over datums, so the pieces' results add up exactly. A request with `own_passes` shares
    no pass with another: its passes are those it gets alone."""
    passes: list[list[PreparedRequest]] = []
    current: list[PreparedRequest] = []
    used = 0

    def piece(r: PreparedRequest, start: int, end: int) -> PreparedRequest:
        return replace(r, tokens=r.tokens[start:end], inputs=r.inputs[start:end], datum_ids=list(range(start, end)))

    for r in requests:
        if r.request.own_passes and current:
            passes.append(current)
            current, used = [], 0
        start, leader = 0, None  # r's piece in the current pass begins at datum `start`
        for d, t in enumerate(r.tokens):
            shared = shared_length(leader, t, min_shared)
            if used + t.numel() - shared > max_tokens and used > 0:
                if d > start:
                    current.append(piece(r, start, d))
                passes.append(current)
                current, used, start, shared = [], 0, d, 0
            if shared == 0:
                leader = t
            used += t.numel() - shared
        current.append(piece(r, start, len(r.tokens)))
        if r.request.own_passes:
            passes.append(current)
            current, used = [], 0
    if current:
        passes.append(current)
    return passes


def _as_tensor(value: TensorLike, where: str) -> Tensor:
    try:
        return value if isinstance(value, Tensor) else torch.as_tensor(np.asarray(value))
    except (TypeError, ValueError) as e:
        raise InvalidInputError(where, f"not a numeric array ({e})") from None


def _token_ids(value: TensorLike, where: str, vocab_size: int) -> Tensor:
    t = _as_tensor(value, where)
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise InvalidInputError(where, f"token ids must be integers, got dtype {t.dtype}")
    t = t.to(torch.int64)
    if t.numel() and (int(t.min()) < 0 or int(t.max()) >= vocab_size):
        bad = t[(t < 0) | (t >= vocab_size)][0].item()
        raise InvalidInputError(where, f"token id {bad} is outside the vocabulary [0, {vocab_size})")
    return t


def _validate_config(loss_fn: str, spec: LossSpec, config: dict[str, Any] | None) -> dict[str, float]:
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


def _validate_datum(i: int, datum: Datum, loss_fn: str, spec: LossSpec, vocab_size: int, max_len: int):
    tokens = _token_ids(datum.tokens, f"data[{i}].model_input", vocab_size)
    if tokens.dim() != 1 or tokens.numel() == 0:
        raise InvalidInputError(f"data[{i}].model_input", f"must be a non-empty list of tokens, got shape {tuple(tokens.shape)}")
    n = tokens.numel()
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
    if targets.dim() not in allowed_dims or targets.shape[0] != n or (targets.dim() == 2 and targets.shape[1] == 0):
        expected = f"({n},) or ({n}, K)" if spec.multi_target else f"({n},)"
        raise InvalidInputError(where, f"shape {tuple(targets.shape)} does not match the model input: expected {expected}")

    inputs = {"target_tokens": targets}
    for key in FLOAT_INPUTS:
        if key not in allowed:
            continue
        where = f"data[{i}].loss_fn_inputs[{key!r}]"
        if key in datum.loss_fn_inputs:
            t = _as_tensor(datum.loss_fn_inputs[key], where)
            if not (t.dtype.is_floating_point or t.dtype in (torch.int32, torch.int64, torch.bool)):
                raise InvalidInputError(where, f"must be numbers, got dtype {t.dtype}")
            t = t.to(torch.float32)
            if t.shape != targets.shape:
                raise InvalidInputError(where, f"shape {tuple(t.shape)} does not match target_tokens {tuple(targets.shape)}")
            if not torch.isfinite(t).all():
                raise InvalidInputError(where, "contains NaN or infinity")
        else:
            t = torch.full(targets.shape, spec.optional_inputs[key], dtype=torch.float32)
        inputs[key] = t
    if spec.check_datum is not None:
        spec.check_datum(i, inputs)
    return tokens, inputs


def prepare_request(index: int, request: ForwardBackwardInput, vocab_size: int, max_len: int) -> PreparedRequest:
    """Validate one request completely (no state is touched); raise InvalidInputError naming the field."""
    spec = LOSSES.get(request.loss_fn)
    if spec is None:
        raise InvalidInputError("loss_fn", f"unknown loss {request.loss_fn!r}; known: {sorted(LOSSES)}")
    if not request.data:
        raise InvalidInputError("data", "must contain at least one datum")
    config = _validate_config(request.loss_fn, spec, request.loss_fn_config)
    tokens, inputs = [], []
    for i, datum in enumerate(request.data):
        t, inp = _validate_datum(i, datum, request.loss_fn, spec, vocab_size, max_len)
        tokens.append(t)
        inputs.append(inp)
    return PreparedRequest(index, request, spec, tokens, inputs, config)


@dataclass
class PackedBatch:
    """All datums of a batch packed into one row of tokens, grouped by adapter so each adapter is
    one segment. A datum's positions map to rows: the rows it shares with its group's leader (see
    `shared_prefix`), then its own; without sharing, position p of the batch is row p."""

    input_ids: Tensor  # [T] one token per row
    position_ids: Tensor  # [T] each row's position in its datum
    layout: AttentionLayout  # which rows attend to which
    adapter_spans: list[tuple[str, int, int]]  # (adapter id, start row, end row)
    targets: Tensor  # [P, K_max] target ids of every datum position ((N,) targets in column 0; padding 0)
    position_rows: Tensor | None  # [P] the row of each datum position; None when that is the identity
    datum_offsets: dict[int, list[int]]  # request index -> first position (in P) of each of its datums


def pack(requests: list[PreparedRequest], min_shared: int = 0) -> PackedBatch:
    order: dict[str, list[PreparedRequest]] = {}
    for r in requests:
        order.setdefault(r.request.adapter_id, []).append(r)
    tokens, positions, targets, position_rows, blocks, spans, offsets = [], [], [], [], [], [], {}
    rows = n_positions = 0
    for adapter_id, reqs in order.items():
        span_start = rows
        for r in reqs:
            offsets[r.index] = []
            group: tuple[int, int, list[tuple[int, int]]] | None = None  # leader's first row and length, members
            for t, inputs, shared in zip(r.tokens, r.inputs, share_plan(r.tokens, min_shared)):
                n = t.numel()
                if shared == 0:
                    if group is not None:
                        blocks.append(_block(*group))
                    group = (rows, n, [])
                    position_rows.append(torch.arange(rows, rows + n))
                else:
                    group[2].append((shared, n - shared))
                    position_rows.append(torch.cat([torch.arange(group[0], group[0] + shared),
                                                    torch.arange(rows, rows + n - shared)]))
                tokens.append(t[shared:])
                positions.append(torch.arange(shared, n))
                targets.append(inputs["target_tokens"].reshape(n, -1))
                offsets[r.index].append(n_positions)
                rows, n_positions = rows + n - shared, n_positions + n
            blocks.append(_block(*group))
        spans.append((adapter_id, span_start, rows))
    k_max = max(t.shape[1] for t in targets)
    target_matrix = torch.cat([torch.nn.functional.pad(t, (0, k_max - t.shape[1])) for t in targets])
    return PackedBatch(
        input_ids=torch.cat(tokens), position_ids=torch.cat(positions), layout=AttentionLayout.build(blocks),
        adapter_spans=spans, targets=target_matrix,
        position_rows=torch.cat(position_rows) if rows < n_positions else None, datum_offsets=offsets,
    )


def _block(start: int, leader_length: int, members: list[tuple[int, int]]) -> tuple[int, int, Tensor | None]:
    """The attention block of one group: a plain causal sequence when it has no members."""
    end = start + leader_length + sum(own for _, own in members)
    return start, end, group_mask(leader_length, members) if members else None

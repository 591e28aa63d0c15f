"""Prepared requests (their arrays as tensors), their engine passes, and packing many into one sequence.

A request is checked and its arrays converted by contract/inputs.py (without torch, so the
API runs the same checks); `prepare_request` makes tensors of them for the engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np
import torch
from torch import Tensor

from contract.inputs import ForwardBackwardInput, check_request
from contract.loss_specs import LossSpec
from workers.trainer.packed_attention import AttentionLayout
from workers.trainer.shared_prefix import group_mask, share_plan, shared_length


@dataclass
class EngineOutput:
    """One forward/forward_backward request's result as the engine gives it: tensors, and the metrics of
    each pass. (The client's `loraplex.types.ForwardBackwardOutput` is what the wire makes of it.)"""

    loss_fn_outputs: list[dict[str, Tensor]]  # per datum, e.g. {"logprobs": float32 [N] or [N, K]}
    metrics: dict[str, float]  # "name:reduction", e.g. "loss:sum"
    # each engine pass's metrics of this request and its datums there, in order: `metrics` is their
    # merge, and parts of a request merge the same way (workers/trainer/parts.py)
    pass_metrics: list[tuple[dict[str, float], int]] = field(default_factory=list)


@dataclass
class PreparedRequest:
    """A checked request: tensors converted, defaults filled."""

    index: int  # position in the caller's list
    request: ForwardBackwardInput
    spec: LossSpec
    tokens: list[Tensor]  # int64 [N_d] per datum
    inputs: list[dict[str, Tensor]]  # per datum, every input the loss reads
    config: dict[str, float]
    datum_ids: list[int] | None = None  # in a piece of a split request: which of its datums these are


def prepare_request(index: int, request: ForwardBackwardInput, vocab_size: int, max_len: int) -> PreparedRequest:
    """Check one request completely (no state is touched; InvalidInputError naming the field) and make
    tensors of its arrays."""
    checked = check_request(request, vocab_size, max_len)
    tokens = [_tensor(t) for t in checked.tokens]
    inputs = [{name: _tensor(array) for name, array in datum.items()} for datum in checked.inputs]
    return PreparedRequest(index, request, checked.spec, tokens, inputs, checked.config)


def _tensor(array: np.ndarray) -> Tensor:
    # no copy, unless the array runs backwards in memory: torch cannot view negative strides
    return torch.from_numpy(np.ascontiguousarray(array))


def split_into_passes(requests: list[PreparedRequest], max_tokens: int,
                      min_shared: int = 0) -> list[list[PreparedRequest]]:
    """Cut a batch into passes of at most `max_tokens` packed rows. Each request is cut into
    pieces as if it ran alone, at datum boundaries (a longer datum gets a piece of its own); a
    datum that shares its first rows with its group's leader in the same piece costs only its own
    rows (`shared_prefix`, as `pack` lays them out). Pieces then fill passes in order and are never
    cut again: a request's pieces, and with them its sharing, its per-pass losses and the order
    its gradient is summed in (workers/sgmv/grad_pieces.py), do not depend on the other requests
    of the batch. Losses are sums over datums, so the pieces' results add up. A request with
    `own_passes` shares no pass with another."""
    passes: list[list[PreparedRequest]] = []
    current: list[PreparedRequest] = []
    used = 0
    for r in requests:
        if r.request.own_passes and current:
            passes.append(current)
            current, used = [], 0
        for piece, rows in _pieces(r, max_tokens, min_shared):
            if current and used + rows > max_tokens:
                passes.append(current)
                current, used = [], 0
            current.append(piece)
            used += rows
        if r.request.own_passes:
            passes.append(current)
            current, used = [], 0
    if current:
        passes.append(current)
    return passes


def _pieces(r: PreparedRequest, max_tokens: int, min_shared: int) -> list[tuple[PreparedRequest, int]]:
    """`r` cut into pieces of at most `max_tokens` rows as it is cut running alone: (piece, its rows)."""
    pieces, start, used, leader = [], 0, 0, None
    for d, t in enumerate(r.tokens):
        shared = shared_length(leader, t, min_shared)
        if used + t.numel() - shared > max_tokens and used > 0:
            pieces.append((_piece(r, start, d), used))
            start, used, shared = d, 0, 0
        if shared == 0:
            leader = t
        used += t.numel() - shared
    pieces.append((_piece(r, start, len(r.tokens)), used))
    return pieces


def _piece(r: PreparedRequest, start: int, end: int) -> PreparedRequest:
    return replace(r, tokens=r.tokens[start:end], inputs=r.inputs[start:end], datum_ids=list(range(start, end)))


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

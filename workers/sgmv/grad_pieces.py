"""LoRA weight gradients summed in an order that depends on nothing but the adapter's own requests.

dA = dV^T X and dB = G^T V are sums over an adapter's token rows. Computed by one GEMM over the
adapter's rows of a pass (the segment loop), or over a grid padded to the pass's longest segment
(the bmm path), their rounding followed the pass: the rows an adapter had in it (the other
tenants decided where a pass was cut) and the grid's width (MKL cuts a reduction longer than 192
into blocks sized by its length: the same 200 rows padded to 256 give other bits). As in
batch-invariant inference kernels (a reduction split the same way whatever the batch), the sum is
built from pieces that are the adapter's own:

- a piece is the rows of one request in one pass. The engine cuts every request into passes as
  if it ran alone (batch.split_into_passes), so its pieces are the same in any batch;
- each piece's product is one [features, rows] x [rows, rank] GEMM, exactly its rows (no
  padding), as one mm or one item of a bmm over pieces of equal length: an item gets the bits a
  lone mm of its shape gets, whatever else the bmm holds, and the big feature dimension as M keeps
  it clear of MKL's few-rows kernels (row_gemm.py);
- the gradient adds the pieces one at a time, in order: G <- ((G + P_1) + P_2) + ...

So an adapter's gradient is the same fp32 additions alone or beside any others, at any position,
on the loop, bmm or stacked path. Two forward_backward calls add two pieces where one call holding
both requests' datums may add one: equal within fp32 rounding (docs/decisions/0022).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

Pieces = tuple[tuple[int, int], ...]  # (start, end) rows of each piece of one segment, in order


@dataclass(frozen=True)
class _LengthGroup:
    """The pieces of one length: [count, length] cells of the packed rows."""

    length: int
    index: torch.Tensor | None  # [count * length] rows; None: a view from `first`
    first: int
    count: int

    def take(self, rows: torch.Tensor) -> torch.Tensor:
        """rows [n_rows, f] -> [count, length, f]."""
        if self.index is None:
            return rows[self.first: self.first + self.count * self.length].view(self.count, self.length, -1)
        return rows.index_select(0, self.index.to(rows.device)).view(self.count, self.length, -1)


@dataclass(frozen=True)
class GradPieces:
    """Every segment's pieces, where each one's product comes from, and the order they are added in."""

    spans: tuple[tuple[int, int], ...]  # (start, end) of each piece, segment after segment
    per_segment: tuple[int, ...]  # pieces of each segment
    groups: tuple[_LengthGroup, ...]
    slot: tuple[tuple[int, int], ...]  # piece -> (group, item)
    steps: tuple[tuple[tuple[int, int], ...], ...]  # steps[i]: (segment, piece) of each segment's i-th piece

    def products(self, big: torch.Tensor, small: torch.Tensor) -> list[torch.Tensor]:
        """Each piece's big^T @ small, from rows [n_rows, *]: one [count, big features, small
        features] tensor per length group."""
        return [torch.bmm(group.take(big).transpose(1, 2), group.take(small)) for group in self.groups]

    def piece(self, products: list[torch.Tensor], piece: int) -> torch.Tensor:
        group, item = self.slot[piece]
        return products[group][item]

    def fold_(self, families: Sequence[tuple[Sequence[torch.Tensor | None], list[torch.Tensor], object]]) -> None:
        """Add the pieces into their segments' gradients, one piece after another.

        families: (per segment, the tensor its pieces are added to, or None to skip it;
        `products` of the pieces; a function from a piece's product to what is added, e.g. a
        transposed view) for each gradient matrix."""
        for step in self.steps:
            dests, sources = [], []
            for per_segment, products, view in families:
                for segment, piece in step:
                    if per_segment[segment] is not None:
                        dests.append(per_segment[segment])
                        sources.append(view(self.piece(products, piece)))
            if dests:
                torch._foreach_add_(dests, sources)


@functools.lru_cache(maxsize=256)
def grad_pieces(pieces: tuple[Pieces, ...]) -> GradPieces:
    """The pieces of segments whose pieces are `pieces[s]`, empty ones dropped (cached: every layer
    of a pass asks)."""
    spans, per_segment = [], []
    for segment_pieces in pieces:
        kept = [(start, end) for start, end in segment_pieces if end > start]
        spans += kept
        per_segment.append(len(kept))
    by_length: dict[int, list[int]] = {}
    for i, (start, end) in enumerate(spans):
        by_length.setdefault(end - start, []).append(i)
    groups, slot = [], [None] * len(spans)
    for g, (length, ids) in enumerate(by_length.items()):
        starts = [spans[i][0] for i in ids]
        if all(start == starts[0] + k * length for k, start in enumerate(starts)):
            groups.append(_LengthGroup(length, None, starts[0], len(ids)))
        else:
            index = torch.cat([torch.arange(start, start + length) for start in starts])
            groups.append(_LengthGroup(length, index, 0, len(ids)))
        for k, i in enumerate(ids):
            slot[i] = (g, k)
    offsets = [0]
    for n in per_segment:
        offsets.append(offsets[-1] + n)
    steps = tuple(tuple((s, offsets[s] + i) for s, n in enumerate(per_segment) if i < n)
                  for i in range(max(per_segment, default=0)))
    return GradPieces(tuple(spans), tuple(per_segment), tuple(groups), tuple(slot), steps)


def whole_segments(bounds: Sequence[tuple[int, int]]) -> tuple[Pieces, ...]:
    """Pieces when the caller names none: each segment is one piece."""
    return tuple(((start, end),) for start, end in bounds)

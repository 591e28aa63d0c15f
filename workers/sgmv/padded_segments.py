"""The segment loop's LoRA math as one bmm per product, over segments padded to a common width.

On a CPU a rank-16 LoRA matmul over a few dozen rows is mostly per-call overhead, so a loop over
8 adapters' segments costs about 8x the calls of one adapter (measured on SmolLM2 sizes: one bmm
over 8 segments of 32 rows is ~4x faster than the 8 matmuls it replaces, forward and backward).
Here the rows are laid out as a [segments, width, features] grid: a plain view when the segments
are equally long and back to back (the common case of many tenants' equal-sized requests), an
index gather otherwise: padding cells read a zero row and are never written back, so only the
rows of a segment get a delta.
Ranks are padded to the largest one with zeros, which adds nothing either. The functions take
the layers of a group that reads one input (segmented_lora.apply_lora_group), or one layer.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from workers.sgmv.segment_ops import PaddedGroups, padded_ranges

MAX_PADDING = 2.0  # grid cells per segment row beyond which the segment loop is cheaper


@dataclass(frozen=True)
class SegmentGrid:
    n_rows: int  # rows of the packed batch, in segments or not
    groups: int
    width: int
    first: int  # row of cell (0, 0) when the grid is a view of the rows
    padded: PaddedGroups | None  # the gather layout; None for a view

    @property
    def is_view(self) -> bool:
        return self.padded is None

    def padding(self, segment_rows: int) -> float:
        return self.groups * self.width / max(segment_rows, 1)

    def to_cells(self, rows: torch.Tensor) -> torch.Tensor:
        """[n_rows, f] -> [groups, width, f]; padding cells are zero."""
        if not self.is_view:
            return self.padded.gather(rows)
        return rows[self.first: self.first + self.groups * self.width].view(self.groups, self.width, -1)

    def add_bmm_(self, rows: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
        """rows [n_rows, f] += bmm(a, b) [groups, width, f] in place, for the rows in a segment only
        (accumulated in the bmm itself when the grid is a view of the rows)."""
        if self.is_view:
            self.to_cells(rows).baddbmm_(a, b)
        else:
            self.padded.add_scattered_(rows, torch.bmm(a, b))


@functools.lru_cache(maxsize=256)
def segment_grid(bounds: tuple[tuple[int, int], ...], n_rows: int) -> SegmentGrid:
    """The grid of segments [start, end) over n_rows packed rows (cached: every layer of a pass
    asks for the same bounds)."""
    lengths = [end - start for start, end in bounds]
    back_to_back = all(bounds[i][1] == bounds[i + 1][0] for i in range(len(bounds) - 1))
    if back_to_back and len(set(lengths)) == 1:
        return SegmentGrid(n_rows, len(bounds), lengths[0], bounds[0][0], None)
    padded = padded_ranges(bounds, n_rows)
    return SegmentGrid(n_rows, len(bounds), padded.cells.shape[1], 0, padded)


def paying_grid(bounds: tuple[tuple[int, int], ...], n_rows: int) -> SegmentGrid | None:
    """The grid of these segments, or None where its padding would cost more than the segment loop."""
    grid = segment_grid(bounds, n_rows)
    return grid if grid.padding(sum(end - start for start, end in bounds)) <= MAX_PADDING else None


def stack_padded(mats, rank_dim: int) -> torch.Tensor:
    """Stack matrices whose `rank_dim` differs (each adapter has its own rank), zero-padding it."""
    max_rank = max(m.shape[rank_dim] for m in mats)
    padded = []
    for m in mats:
        pad = max_rank - m.shape[rank_dim]
        padded.append(F.pad(m, (0, pad) if rank_dim == 1 else (0, 0, 0, pad)) if pad else m)
    return torch.stack(padded)


def forward_(x2, outs, grid: SegmentGrid, scales, lora_as, lora_bs):
    """outs[i] += each segment's scale * x A_i^T B_i^T, in place, for every layer i of a group that
    reads the same input (lora_as[i] / lora_bs[i]: layer i's matrices, one per segment).
    Returns what the backward needs."""
    stacked_as = [stack_padded(a, rank_dim=0) for a in lora_as]  # [G, R, in] per layer
    stacked_bs = [stack_padded(b, rank_dim=1) for b in lora_bs]  # [G, out_i, R] per layer
    scale = torch.tensor(scales, dtype=x2.dtype).view(-1, 1, 1)
    return stacked_forward_(x2, outs, grid, scale, stacked_as, stacked_bs)


def stacked_forward_(x2, outs, grid: SegmentGrid, scale, stacked_as, stacked_bs):
    """`forward_` with every layer's matrices already stacked over segments (stacked_as[i]
    [G, R, in], stacked_bs[i] [G, out_i, R]) and the scales as a [G, 1, 1] tensor."""
    a_cat = stacked_as[0] if len(stacked_as) == 1 else torch.cat(stacked_as, dim=1)  # [G, layers * R, in]
    x_cells = grid.to_cells(x2)
    # one shrink per layer: one bmm over the layers' concatenated A's rounded differently enough
    # from the loop's matmul to take the batch-invariance test's worst gradient error (tiny model,
    # amplified through its layers) from 2.8e-6 to 1.45e-5, over its 1e-5 bound
    vs = [torch.bmm(x_cells, a.transpose(1, 2)) for a in stacked_as]
    scaled_v = (vs[0] if len(vs) == 1 else torch.cat(vs, dim=2)).mul_(scale)  # [G, W, layers * R]
    for out, b, v in zip(outs, stacked_bs, scaled_v.chunk(len(outs), dim=-1)):
        grid.add_bmm_(out, v, b.transpose(1, 2))
    return [x_cells, a_cat, scale, scaled_v, *stacked_bs]


def backward_(gs, dx, grid: SegmentGrid, saved, ranks: list[int]):
    """Adds the LoRA part of dX into dx (unless None); returns dA and dB per layer and segment,
    from the output gradients gs[i] [n_rows, out_i]."""
    stacked_grad_as, stacked_grad_bs = stacked_backward_(gs, dx, grid, saved)
    grad_as = [[grad_a[s, :r] for s, r in enumerate(ranks)] for grad_a in stacked_grad_as]
    grad_bs = [[grad_b[s, :, :r] for s, r in enumerate(ranks)] for grad_b in stacked_grad_bs]
    return grad_as, grad_bs


def stacked_backward_(gs, dx, grid: SegmentGrid, saved, grad_as_out=None, grad_bs_out=None):
    """`backward_` with dA and dB stacked over segments: [G, R, in] and [G, out_i, R] per layer,
    returned, or written into grad_as_out / grad_bs_out (one tensor of that shape per layer)."""
    x_cells, a_cat, scale, scaled_v, *stacked_bs = saved
    g_cells = [grid.to_cells(g) for g in gs]
    dvs = [torch.bmm(g, b) for g, b in zip(g_cells, stacked_bs)]  # [G, W, R] per layer
    dv = (dvs[0] if len(dvs) == 1 else torch.cat(dvs, dim=2)).mul_(scale)
    if grad_as_out is None:  # one bmm for every layer's dA: [G, layers * R, in]
        grad_as = torch.bmm(dv.transpose(1, 2), x_cells).chunk(len(gs), dim=1)
    else:
        grad_as = [torch.bmm(dv_layer.transpose(1, 2), x_cells, out=out)
                   for dv_layer, out in zip(dv.chunk(len(gs), dim=2), grad_as_out)]
    grad_bs = [torch.bmm(g.transpose(1, 2), v, out=out) for g, v, out in  # [G, out, R]
               zip(g_cells, scaled_v.chunk(len(gs), dim=-1), grad_bs_out or [None] * len(gs))]
    if dx is not None:
        grid.add_bmm_(dx, dv, a_cat)
    return grad_as, grad_bs

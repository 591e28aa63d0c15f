"""The segment loop's LoRA math as one bmm per product, over segments padded to a common width.

On a CPU a rank-16 LoRA matmul over a few dozen rows is mostly per-call overhead, so a loop over
8 adapters' segments costs about 8x the calls of one adapter (measured on SmolLM2 sizes: one bmm
over 8 segments of 32 rows is ~4x faster than the 8 matmuls it replaces, forward and backward).
Here the rows are laid out as a [segments, width, features] grid: a plain view when the segments
are equally long and back to back (the common case of many tenants' equal-sized requests), an
index gather otherwise, with a zero row in every padding cell so padding never adds a delta.
Ranks are padded to the largest one with zeros, which adds nothing either.
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

    def from_cells(self, cells: torch.Tensor) -> torch.Tensor:
        """[groups, width, f] -> [n_rows, f]; rows outside every segment are zero."""
        if not self.is_view:
            return self.padded.scatter(cells)
        flat = cells.reshape(-1, cells.shape[-1])
        rows = flat.new_empty(self.n_rows, flat.shape[1])
        end = self.first + flat.shape[0]
        rows[: self.first] = 0
        rows[self.first: end] = flat
        rows[end:] = 0
        return rows


@functools.lru_cache(maxsize=256)
def segment_grid(bounds: tuple[tuple[int, int], ...], n_rows: int) -> SegmentGrid:
    """The grid of segments [start, end) over n_rows packed rows (cached: every layer of a pass
    asks for the same bounds)."""
    lengths = [end - start for start, end in bounds]
    back_to_back = all(bounds[i][1] == bounds[i + 1][0] for i in range(len(bounds) - 1))
    if back_to_back and len(set(lengths)) == 1:
        return SegmentGrid(n_rows, len(bounds), lengths[0], bounds[0][0], None)
    padded = padded_ranges(bounds, n_rows)  # one spare cell per group at least: rows outside segments read a zero
    return SegmentGrid(n_rows, len(bounds), padded.cells.shape[1], 0, padded)


def stack_padded(mats, rank_dim: int) -> torch.Tensor:
    """Stack matrices whose `rank_dim` differs (each adapter has its own rank), zero-padding it."""
    max_rank = max(m.shape[rank_dim] for m in mats)
    padded = []
    for m in mats:
        pad = max_rank - m.shape[rank_dim]
        padded.append(F.pad(m, (0, pad) if rank_dim == 1 else (0, 0, 0, pad)) if pad else m)
    return torch.stack(padded)


def forward_(x2, out2, grid: SegmentGrid, scales, lora_as, lora_bs):
    """out2 += each segment's scale * x A^T B^T, in place. Returns what the backward needs."""
    stacked_a = stack_padded(lora_as, rank_dim=0)  # [G, R, in]
    stacked_b = stack_padded(lora_bs, rank_dim=1)  # [G, out, R]
    scale = torch.tensor(scales, dtype=x2.dtype).view(-1, 1, 1)
    x_cells = grid.to_cells(x2)
    scaled_v = torch.bmm(x_cells, stacked_a.transpose(1, 2)).mul_(scale)  # [G, W, R]
    if grid.is_view:
        grid.to_cells(out2).baddbmm_(scaled_v, stacked_b.transpose(1, 2))
    else:
        out2.add_(grid.from_cells(torch.bmm(scaled_v, stacked_b.transpose(1, 2))))
    return [x_cells, stacked_a, stacked_b, scale, scaled_v]


def backward(g2, grid: SegmentGrid, saved, ranks: list[int], need_dx: bool):
    """dX (or None) and each segment's dA, dB, from the output gradient g2 [n_rows, out]."""
    x_cells, stacked_a, stacked_b, scale, scaled_v = saved
    g_cells = grid.to_cells(g2)
    dv = torch.bmm(g_cells, stacked_b).mul_(scale)  # [G, W, R]
    grad_b = torch.bmm(g_cells.transpose(1, 2), scaled_v)  # [G, out, R]
    grad_a = torch.bmm(dv.transpose(1, 2), x_cells)  # [G, R, in]
    dx = grid.from_cells(torch.bmm(dv, stacked_a)) if need_dx else None
    return dx, [grad_a[i, :r] for i, r in enumerate(ranks)], [grad_b[i, :, :r] for i, r in enumerate(ranks)]

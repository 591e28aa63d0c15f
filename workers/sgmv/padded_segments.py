"""The segment loop's LoRA math as one bmm per product, over segments padded to a common width.

On a CPU a rank-16 LoRA matmul over a few dozen rows is mostly per-call overhead, so a loop over
8 adapters' segments costs about 8x the calls of one adapter (measured on SmolLM2 sizes: one bmm
over 8 segments of 32 rows is ~4x faster than the 8 matmuls it replaces, forward and backward).
Here the rows are laid out as a [segments, width, features] grid: a plain view when the segments
are equally long and back to back (the common case of many tenants' equal-sized requests), an
index gather otherwise: padding cells read a zero row and are never written back, so only the
rows of a segment get a delta.

It gives every row the bits the segment loop gives it (segmented_lora.py), so which of the two a
pass takes does not show in any result:
- the same products of the same shapes: one shrink over the layers' concatenated A's, each
  layer's expand from the scaled v, dV = (G B) * scale, dX += dV A_cat. A bmm item gets the bits
  of a lone mm of its shape, and a row those of any product of at least `row_gemm.min_rows()`
  rows, which the grid's width is held to;
- the segments of one bmm share a rank (a pass of mixed ranks runs one bmm per rank), never
  zero-padded to another adapter's: MKL computes a product of 8 columns with other kernels than
  one of 16;
- a product accumulated into a tensor adds the way addmm does (into the gathered cells, then
  written back), as the loop's addmm into the rows;
- the weight gradients come from each request's own rows (grad_pieces.py), not from the grid.
The functions take the layers of a group that reads one input (segmented_lora.apply_lora_group),
or one layer.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from workers.sgmv.grad_pieces import GradPieces
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

    def to_rows(self, cells: torch.Tensor) -> torch.Tensor:
        """[groups, width, f] -> a new [n_rows, f] holding each segment row's cell (other rows: unset)."""
        flat = cells.reshape(-1, cells.shape[-1])
        rows = flat.new_empty(self.n_rows, flat.shape[1])
        if self.is_view:
            rows[self.first: self.first + flat.shape[0]] = flat
        else:
            covered = self._covered(flat.device)
            rows.index_copy_(0, covered, flat.index_select(0, self.padded.position.to(flat.device)[covered]))
        return rows

    def add_bmm_(self, rows: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
        """rows [n_rows, f] += bmm(a, b) [groups, width, f] in place, for the rows in a segment only,
        added as addmm adds (MKL accumulates into the cells themselves)."""
        if self.is_view:
            self.to_cells(rows).baddbmm_(a, b)
            return
        cells = self.padded.gather_rows(rows).baddbmm_(a, b).view(-1, rows.shape[1])
        covered = self._covered(rows.device)
        rows.index_copy_(0, covered, cells.index_select(0, self.padded.position.to(rows.device)[covered]))

    def _covered(self, device) -> torch.Tensor:
        covered = self.padded.covered
        return torch.arange(self.n_rows, device=device) if covered is None else covered.to(device)


@functools.lru_cache(maxsize=256)
def segment_grid(bounds: tuple[tuple[int, int], ...], n_rows: int, min_width: int = 1) -> SegmentGrid:
    """The grid of segments [start, end) over n_rows packed rows, at least `min_width` cells wide
    (cached: every layer of a pass asks for the same bounds)."""
    lengths = [end - start for start, end in bounds]
    back_to_back = all(bounds[i][1] == bounds[i + 1][0] for i in range(len(bounds) - 1))
    if back_to_back and len(set(lengths)) == 1 and lengths[0] >= min_width:
        return SegmentGrid(n_rows, len(bounds), lengths[0], bounds[0][0], None)
    padded = padded_ranges(bounds, n_rows, min_width)
    return SegmentGrid(n_rows, len(bounds), padded.cells.shape[1], 0, padded)


def paying_grid(bounds: tuple[tuple[int, int], ...], n_rows: int, min_width: int = 1) -> SegmentGrid | None:
    """The grid of these segments, or None where its padding would cost more than the segment loop."""
    grid = segment_grid(bounds, n_rows, min_width)
    return grid if grid.padding(sum(end - start for start, end in bounds)) <= MAX_PADDING else None


def stack_padded(mats, rank_dim: int, rank: int | None = None) -> torch.Tensor:
    """Stack matrices whose `rank_dim` differs (each adapter has its own rank), zero-padding it to
    the largest (or to `rank`)."""
    rank = max(m.shape[rank_dim] for m in mats) if rank is None else rank
    padded = []
    for m in mats:
        pad = rank - m.shape[rank_dim]
        padded.append(F.pad(m, (0, pad) if rank_dim == 1 else (0, 0, 0, pad)) if pad else m)
    return torch.stack(padded)


def stacked_forward_(x2, outs, grid: SegmentGrid, scale, a_cat, stacked_bs) -> torch.Tensor:
    """outs[i] += each segment's scale * x A_i^T B_i^T, in place, for every layer i of a group that
    reads the same input. a_cat [G, layers * R, in]: the layers' A's of each segment, layer after
    layer; stacked_bs[i] [G, out_i, R]; scale [G, 1, 1]. Returns the scaled v in rows layout
    [n_rows, layers * R] (the weight gradients' tiles read it)."""
    scaled_v = torch.bmm(grid.to_cells(x2), a_cat.transpose(1, 2)).mul_(scale)  # [G, W, layers * R]
    for out, b, v in zip(outs, stacked_bs, scaled_v.chunk(len(outs), dim=-1)):
        grid.add_bmm_(out, v, b.transpose(1, 2))
    return grid.to_rows(scaled_v)


def stacked_backward_(gs, dx, grid: SegmentGrid, scale, a_cat, stacked_bs) -> torch.Tensor:
    """Adds the LoRA part of dX into dx (unless None), from the output gradients gs[i] [n_rows, out_i];
    returns dV in rows layout [n_rows, layers * R] (the weight gradients read it)."""
    dvs = [torch.bmm(grid.to_cells(g), b) for g, b in zip(gs, stacked_bs)]  # [G, W, R] per layer
    dv = (dvs[0] if len(dvs) == 1 else torch.cat(dvs, dim=2)).mul_(scale)
    if dx is not None:
        grid.add_bmm_(dx, dv, a_cat)
    return grid.to_rows(dv)


def weight_grad_families(pieces: GradPieces, x2, gs, dv_rows, sv_rows, rank: int, width: int,
                         grad_as, grad_bs) -> list:
    """The fold of a group's weight gradients (GradPieces.fold_): per layer i, its dA added into
    grad_as[i][s] and its dB into grad_bs[i][s] (per segment s of `pieces`), each piece's product
    computed `width` wide and its first `rank` columns added."""
    products_a = pieces.products(x2, dv_rows)  # [count, in, layers * width] per length
    families = []
    for i, g in enumerate(gs):
        products_b = pieces.products(g, sv_rows[:, i * width: (i + 1) * width])  # [count, out_i, width]
        cols = slice(i * width, i * width + rank)
        families.append((grad_as[i], products_a, lambda p, cols=cols: p[:, cols].t()))
        families.append((grad_bs[i], products_b, lambda p: p[:, :rank]))
    return families

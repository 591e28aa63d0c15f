"""The two LoRA matmuls over one adapter's rows, shared by the trainer and the sampler on CPU.

The trainer packs each adapter's tokens into one contiguous segment (rows = a slice); vLLM's
batches interleave adapters, so the sampler groups rows per adapter slot once per step (rows =
an index tensor). Either way each adapter costs one shrink and one expand matmul per layer,
instead of vLLM's stock CPU path that gathers a full weight matrix per token. Rows in no group
(no adapter) are never touched.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

Rows = slice | torch.Tensor  # a contiguous range, or the row indices of one adapter


def take(x: torch.Tensor, rows: Rows) -> torch.Tensor:
    return x[rows] if isinstance(rows, slice) else x.index_select(0, rows)


def shrink(x: torch.Tensor, lora_a: torch.Tensor, rows: Rows) -> torch.Tensor:
    """v = x[rows] @ A^T, with A [rank, in]."""
    return F.linear(take(x, rows), lora_a)


def expand_(out: torch.Tensor, v: torch.Tensor, lora_b: torch.Tensor, rows: Rows, scale: float = 1.0) -> None:
    """out[rows] += scale * v @ B^T in place, with B [out, rank]; `out` may be a column slice."""
    if isinstance(rows, slice):  # the scale folded into addmm: no [tokens, out] temporary
        out[rows].addmm_(v, lora_b.t(), alpha=scale)
    else:
        out.index_add_(0, rows, v @ lora_b.t(), alpha=scale)


@dataclass(frozen=True)
class SlotRows:
    slot: int  # the adapter's slot in stacked weights
    rows: Rows


def group_rows_by_slot(slots: torch.Tensor) -> list[SlotRows]:
    """The rows of each slot >= 0 (a negative slot means no adapter), as a slice where contiguous."""
    slots = slots.to("cpu", torch.int64)
    groups = []
    for slot in torch.unique(slots).tolist():
        if slot < 0:
            continue
        rows = torch.nonzero(slots == slot).flatten()
        start, end = int(rows[0]), int(rows[-1]) + 1
        groups.append(SlotRows(slot, slice(start, end) if end - start == rows.numel() else rows))
    return groups

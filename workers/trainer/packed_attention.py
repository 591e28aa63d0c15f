"""Causal attention over packed sequences, registered as a transformers attention implementation.

All datums of a batch travel as one row of tokens. A block-diagonal mask over the whole row
would cost T^2 attention for a row of T tokens; instead each datum attends within its own rows,
datums of equal length share one batched SDPA call, and a group of datums that share their first
rows (`shared_prefix`) is one SDPA call with its own mask. The layout is built once per pass and
handed to every layer through the model's keyword arguments. Because the name is not a known
mask implementation, transformers builds no T x T mask for it.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor
from transformers import AttentionInterface

ATTN_IMPLEMENTATION = "loraplex_packed"
LAYOUT_KWARG = "loraplex_layout"


@dataclass(frozen=True)
class AttentionLayout:
    """Which rows of the packed row attend to which."""

    single: list[slice]  # a causal sequence whose length no other has
    same_length: list[tuple[int, Tensor]]  # (length, rows of several causal sequences of that length)
    masked: list[tuple[slice, Tensor]]  # a shared-prefix group: its rows and boolean mask

    @staticmethod
    def build(blocks: list[tuple[int, int, Tensor | None]]) -> "AttentionLayout":
        """blocks: (start, end, mask) per contiguous block of rows; mask None for one causal sequence."""
        by_length: dict[int, list[int]] = defaultdict(list)
        masked = []
        for start, end, mask in blocks:
            if mask is None:
                by_length[end - start].append(start)
            else:
                masked.append((slice(start, end), mask))
        single, same_length = [], []
        for length, starts in by_length.items():
            if len(starts) == 1:
                single.append(slice(starts[0], starts[0] + length))
            else:
                same_length.append((length, torch.cat([torch.arange(s, s + length) for s in starts])))
        return AttentionLayout(single, same_length, masked)

    def blocks(self) -> list[tuple[int, int]]:
        """[start, end) of every block (a datum, or a group sharing a prompt), in row order."""
        blocks = [(rows.start, rows.stop) for rows in self.single]
        for length, rows in self.same_length:
            blocks += [(start, start + length) for start in rows[::length].tolist()]
        blocks += [(rows.start, rows.stop) for rows, _ in self.masked]
        return sorted(blocks)

    def padded(self, n_rows: int, rows: int) -> "AttentionLayout":
        """This layout over `n_rows` rows with `rows` more after them, which attend among themselves
        (a pass padded to a least number of rows: they are no datum's)."""
        return AttentionLayout([*self.single, slice(n_rows, n_rows + rows)], self.same_length, self.masked)

    def to(self, device: torch.device) -> "AttentionLayout":
        return AttentionLayout(self.single, [(n, rows.to(device)) for n, rows in self.same_length],
                               [(rows, mask.to(device)) for rows, mask in self.masked])


def packed_causal_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """query [1, H, T, D], key/value [1, H_kv, T, D] -> output [1, T, H, D]."""
    layout: AttentionLayout | None = kwargs.get(LAYOUT_KWARG)
    if layout is None:  # one unpadded sequence (e.g. plain use of the wrapped model)
        layout = AttentionLayout([slice(0, query.shape[2])], [], [])
    if query.shape[0] != 1:
        raise ValueError("packed attention expects one packed row (batch size 1)")
    if query.shape[1] != key.shape[1]:
        # grouped-query attention with each key/value head repeated, not SDPA's enable_gqa: its CPU
        # backward sums a shared head's gradient over its query heads in an order that follows the
        # thread count (tiny's 2 query heads on 1 kv head, 5 rows: other bits on 2 threads than on 1)
        repeats = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(repeats, dim=1), value.repeat_interleave(repeats, dim=1)

    def attend(rows, **how):
        return F.scaled_dot_product_attention(query[:, :, rows], key[:, :, rows], value[:, :, rows],
                                              scale=scaling, **how)

    out = torch.empty_like(query)
    for rows in layout.single:
        out[:, :, rows] = attend(rows, is_causal=True)
    for length, rows in layout.same_length:
        q, k, v = (t[0, :, rows].unflatten(1, (-1, length)).transpose(0, 1) for t in (query, key, value))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling)
        out[0, :, rows] = o.transpose(0, 1).flatten(1, 2)
    for rows, mask in layout.masked:
        out[:, :, rows] = attend(rows, attn_mask=mask)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(ATTN_IMPLEMENTATION, packed_causal_attention)

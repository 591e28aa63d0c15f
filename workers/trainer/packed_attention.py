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


def packed_causal_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                            sliding_window=None, softcap=None, **kwargs):
    """query [1, H, T, D], key/value [1, H_kv, T, D] -> output [1, T, H, D]. `sliding_window` (Mistral, Gemma 2's
    local layers): a position attends to itself and the window - 1 before it; `softcap` (Gemma 2): scores
    pass through softcap * tanh(score / softcap) before the softmax, as transformers' eager attention does."""
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

    def attend(q, k, v, mask: Tensor | None, positions: Tensor):
        """q/k/v [N, H, L, D] of one block each; mask [L, L] (None: causal); positions [L] of its rows."""
        window = sliding_window if sliding_window is not None and positions.max() >= sliding_window else None
        if window is None and softcap is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=mask is None, attn_mask=mask, scale=scaling)
        allowed = mask if mask is not None else torch.ones(len(positions), len(positions), dtype=torch.bool,
                                                           device=q.device).tril()
        if window is not None:
            allowed = allowed & (positions[:, None] - positions[None, :] < window)
        if softcap is None:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scaling)
        return soft_capped_attention(q, k, v, allowed, scaling if scaling is not None else q.shape[-1] ** -0.5,
                                     softcap)

    out = torch.empty_like(query)
    for rows in layout.single:
        out[:, :, rows] = attend(query[:, :, rows], key[:, :, rows], value[:, :, rows], None,
                                 torch.arange(rows.stop - rows.start, device=query.device))
    for length, rows in layout.same_length:
        q, k, v = (t[0, :, rows].unflatten(1, (-1, length)).transpose(0, 1) for t in (query, key, value))
        o = attend(q, k, v, None, torch.arange(length, device=query.device))
        out[0, :, rows] = o.transpose(0, 1).flatten(1, 2)
    for rows, mask in layout.masked:  # a shared prompt's tree: a row's position is how many rows it sees, less one
        out[:, :, rows] = attend(query[:, :, rows], key[:, :, rows], value[:, :, rows], mask, mask.sum(-1) - 1)
    return out.transpose(1, 2).contiguous(), None


def soft_capped_attention(q: Tensor, k: Tensor, v: Tensor, allowed: Tensor, scaling: float, softcap: float) -> Tensor:
    """transformers' eager attention with soft-capped scores, written so that its bits do not follow the
    thread count (batch invariance, docs/decisions/0022-batch-invariant-training.md): one [rows, rows]
    product per (datum, head), and the softmax as exp / sum. A batched matmul's backward, and torch's
    softmax backward (a 30-row tiny Gemma 2 datum: gradients 1e-6 apart on 1 and 2 threads), sum in
    an order that follows the threads; mm, exp and a row's sum do not."""
    out = torch.empty_like(q)
    for n in range(q.shape[0]):
        for h in range(q.shape[1]):
            scores = torch.tanh(torch.mm(q[n, h], k[n, h].T) * scaling / softcap) * softcap
            scores = scores.masked_fill(~allowed, float("-inf"))
            exp = torch.exp(scores - scores.amax(dim=-1, keepdim=True).detach())
            out[n, h] = torch.mm(exp / exp.sum(dim=-1, keepdim=True), v[n, h])
    return out


AttentionInterface.register(ATTN_IMPLEMENTATION, packed_causal_attention)

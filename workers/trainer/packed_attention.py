"""Causal attention over packed sequences, registered as a transformers attention implementation.

All datums of a batch travel as one row of tokens. A block-diagonal mask over the whole row
would cost T^2 attention for a row of T tokens; instead each datum attends within its own
[start, end) range, and datums of equal length share one batched SDPA call.
Because the name is not a known mask implementation, transformers builds no T x T mask for it.
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

ATTN_IMPLEMENTATION = "loraplex_packed"
SEQ_BOUNDS_KWARG = "loraplex_seq_bounds"


def packed_causal_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """query [1, H, T, D], key/value [1, H_kv, T, D] -> output [1, T, H, D]."""
    bounds: list[int] | None = kwargs.get(SEQ_BOUNDS_KWARG)
    if bounds is None:  # one unpadded sequence (e.g. plain use of the wrapped model)
        bounds = [0, query.shape[2]]
    if query.shape[0] != 1:
        raise ValueError("packed attention expects one packed row (batch size 1)")
    gqa = query.shape[1] != key.shape[1]

    by_length: dict[int, list[int]] = defaultdict(list)
    for start, end in zip(bounds[:-1], bounds[1:]):
        by_length[end - start].append(start)

    out = torch.empty_like(query)
    for length, starts in by_length.items():
        if len(starts) == 1:
            sl = slice(starts[0], starts[0] + length)
            out[:, :, sl] = F.scaled_dot_product_attention(
                query[:, :, sl], key[:, :, sl], value[:, :, sl], is_causal=True, scale=scaling, enable_gqa=gqa
            )
            continue
        rows = torch.cat([torch.arange(s, s + length) for s in starts]).to(query.device)
        q, k, v = (t[0, :, rows].unflatten(1, (len(starts), length)).transpose(0, 1) for t in (query, key, value))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling, enable_gqa=gqa)
        out[0, :, rows] = o.transpose(0, 1).flatten(1, 2)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(ATTN_IMPLEMENTATION, packed_causal_attention)

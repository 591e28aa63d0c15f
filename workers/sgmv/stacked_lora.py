"""A LoRA group over weights already stacked per segment, its weight gradients added where the caller says.

`segmented_lora.apply_lora_group` takes one A and B per layer and segment: on its bmm path it
stacks them on every call. When the caller holds every segment's matrices side by side already
(the trainer stacks a pass's adapters once, workers/trainer/stacked_adapters.py), each layer's
stacked A and B are views, and the backward adds each segment's dA and dB piece by piece
(grad_pieces.py) into the gradient tensors the caller names (each adapter's own `.grad` views).
Same math and the same bmm calls as the bmm path (padded_segments.py), so the same bits; CPU only,
adapters of one rank (>= 2: a rank-1 product is computed 2 wide, row_gemm.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from workers.sgmv import padded_segments
from workers.sgmv.grad_pieces import GradPieces
from workers.sgmv.padded_segments import SegmentGrid
from workers.sgmv.segmented_lora import base_input_grad


@dataclass(frozen=True)
class StackedLayer:
    """One layer's matrices of every segment: [G, rank, in] and [G, out, rank], and the tensors
    each segment's dA and dB are added into (None when no backward is wanted)."""

    lora_a: torch.Tensor
    lora_b: torch.Tensor
    grad_a: tuple[torch.Tensor, ...] | None
    grad_b: tuple[torch.Tensor, ...] | None


def apply_stacked_lora_group(x: torch.Tensor, layers: list[torch.nn.Linear], stacked: list[StackedLayer],
                             grid: SegmentGrid, scale: torch.Tensor, weights: torch.Tensor,
                             pieces: GradPieces) -> list[torch.Tensor]:
    """[layer(x) + its LoRA delta for each layer], as one autograd node. `weights` is the tensor
    the stacked matrices are views of: when it requires grad the node has a backward, which adds
    each layer's dA and dB piece by piece (`pieces`: segment s is the stacked segment s) into its
    `grad_a` / `grad_b`; autograd itself gets no weight gradient. `scale` [G, 1, 1] per segment."""
    bases = tuple((layer.weight, layer.bias) for layer in layers)
    return list(_StackedLoRAGroup.apply(x, bases, stacked, grid, scale, pieces, weights))


class _StackedLoRAGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, bases, stacked, grid, scale, pieces, weights):
        x2 = x.reshape(-1, x.shape[-1])
        outs = [F.linear(x2, weight, bias) for weight, bias in bases]
        a_cat = torch.cat([s.lora_a for s in stacked], dim=1) if len(stacked) > 1 else stacked[0].lora_a
        sv_rows = padded_segments.stacked_forward_(x2, outs, grid, scale, a_cat, [s.lora_b for s in stacked])
        ctx.bases, ctx.stacked, ctx.grid, ctx.pieces, ctx.x_shape = bases, stacked, grid, pieces, x.shape
        ctx.save_for_backward(x2, sv_rows, a_cat, scale)
        return tuple(out.view(*x.shape[:-1], out.shape[-1]) for out in outs)

    @staticmethod
    def backward(ctx, *grad_outs):
        x2, sv_rows, a_cat, scale = ctx.saved_tensors
        stacked = ctx.stacked
        gs = [g.reshape(-1, g.shape[-1]) for g in grad_outs]
        dx = base_input_grad(gs, ctx.bases) if ctx.needs_input_grad[0] else None
        dv_rows = padded_segments.stacked_backward_(gs, dx, ctx.grid, scale, a_cat, [s.lora_b for s in stacked])
        rank = stacked[0].lora_a.shape[1]
        ctx.pieces.fold_(padded_segments.weight_grad_families(
            ctx.pieces, x2, gs, dv_rows, sv_rows, rank, rank, [s.grad_a for s in stacked], [s.grad_b for s in stacked]))
        dx = dx.view(ctx.x_shape) if dx is not None else None
        return dx, None, None, None, None, None, None

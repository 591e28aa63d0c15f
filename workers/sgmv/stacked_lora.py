"""A LoRA group over weights already stacked per segment, with its weight gradients written in place.

`segmented_lora.apply_lora_group` takes one A and B per layer and segment: on its bmm path it
stacks them on every call and hands each segment's dA and dB back one by one. When the caller
holds every segment's matrices side by side already (the trainer stacks a pass's adapters once,
workers/trainer/stacked_adapters.py), each layer's stacked A and B are views, and the backward
writes each layer's stacked dA and dB straight into views of the caller's gradient buffer: per
layer one bmm per product and nothing per segment. Same math and the same bmm calls as the bmm
path (padded_segments.py); CPU only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from workers.sgmv import padded_segments
from workers.sgmv.padded_segments import SegmentGrid
from workers.sgmv.segmented_lora import base_input_grad


@dataclass(frozen=True)
class StackedLayer:
    """One layer's matrices of every segment: [G, rank, in] and [G, out, rank], and where its
    gradients go (same shapes; None when no backward is wanted)."""

    lora_a: torch.Tensor
    lora_b: torch.Tensor
    grad_a: torch.Tensor | None
    grad_b: torch.Tensor | None


def apply_stacked_lora_group(x: torch.Tensor, layers: list[torch.nn.Linear], stacked: list[StackedLayer],
                             grid: SegmentGrid, scale: torch.Tensor, weights: torch.Tensor,
                             on_backward: Callable[[], None]) -> list[torch.Tensor]:
    """[layer(x) + its LoRA delta for each layer], as one autograd node. `weights` is the tensor
    the stacked matrices are views of: when it requires grad the node has a backward, which
    writes (not adds) each layer's dA and dB into its `grad_a` / `grad_b`, then calls
    `on_backward`; autograd itself gets no weight gradient. `scale` [G, 1, 1] per segment."""
    bases = tuple((layer.weight, layer.bias) for layer in layers)
    return list(_StackedLoRAGroup.apply(x, bases, stacked, grid, scale, on_backward, weights))


class _StackedLoRAGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, bases, stacked, grid, scale, on_backward, weights):
        x2 = x.reshape(-1, x.shape[-1])
        outs = [F.linear(x2, weight, bias) for weight, bias in bases]
        saved = padded_segments.stacked_forward_(x2, outs, grid, scale, [s.lora_a for s in stacked],
                                                 [s.lora_b for s in stacked])
        ctx.bases, ctx.stacked, ctx.grid, ctx.on_backward, ctx.x_shape = bases, stacked, grid, on_backward, x.shape
        ctx.save_for_backward(*saved)
        return tuple(out.view(*x.shape[:-1], out.shape[-1]) for out in outs)

    @staticmethod
    def backward(ctx, *grad_outs):
        gs = [g.reshape(-1, g.shape[-1]) for g in grad_outs]
        dx = base_input_grad(gs, ctx.bases) if ctx.needs_input_grad[0] else None
        padded_segments.stacked_backward_(gs, dx, ctx.grid, ctx.saved_tensors,
                                          [s.grad_a for s in ctx.stacked], [s.grad_b for s in ctx.stacked])
        ctx.on_backward()
        dx = dx.view(ctx.x_shape) if dx is not None else None
        return dx, None, None, None, None, None, None

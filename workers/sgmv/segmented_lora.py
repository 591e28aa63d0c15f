"""The LoRA delta of many adapters over packed tokens, as one autograd function.

Tokens are packed so that each adapter owns one contiguous row range (a segment). For segment s
with adapter weights A_s [r_s, in], B_s [out, r_s] and scale s_s:

    forward   v   = x_s @ A_s^T                 (shrink)
              y_s += s_s * v @ B_s^T            (expand, added into the base output in place)
    backward  g   = s_s * dY_s
              dV  = g @ B_s                     (a shrink)
              dX_s = dV @ A_s                   (an expand)
              dB_s = g^T @ v,  dA_s = dV^T @ x_s (per-segment reductions over tokens)

Three backends compute the same math:
- "loop": a segment loop of plain torch matmuls (it performs the same matmuls as peft, so
  results match peft bit for bit or nearly so);
- "bmm": one batched matmul per product over segments padded to a common width (CPU; see
  padded_segments.py), which saves the per-call overhead that dominates small segments;
- "triton": Triton SGMV kernels over rank-padded stacked weights (GPU).
"auto" picks Triton for GPU tensors; on CPU, bmm for several segments unless their padding
would double the rows or the layer is vocabulary-wide (lm_head, where the loop's in-place
update saves [tokens, vocab] temporaries and per-call overhead is negligible), else the loop.
Rows outside every segment get no delta.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from workers.sgmv import padded_segments, segment_ops
from workers.sgmv.padded_segments import segment_grid, stack_padded


@dataclass(frozen=True)
class Segment:
    start: int
    end: int
    lora_a: torch.Tensor  # [rank, in_features]
    lora_b: torch.Tensor  # [out_features, rank]
    scale: float


BACKENDS = ("auto", "loop", "bmm", "triton")
BMM_MAX_OUT_FEATURES = 16384  # wider outputs (an unembedding) take the loop under "auto"


def apply_segmented_lora(
    x: torch.Tensor, base_out: torch.Tensor, segments: list[Segment], backend: str = "auto"
) -> torch.Tensor:
    """Return base_out + the LoRA delta of every segment (base_out is updated in place).

    x: [..., in_features], base_out: [..., out_features] with the same leading dims; the
    leading dims are flattened into one token axis.
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown SGMV backend {backend!r}; choose from {BACKENDS}")
    if not segments:
        return base_out
    bounds = tuple((s.start, s.end) for s in segments)
    scales = tuple(s.scale for s in segments)
    weights = [s.lora_a.to(x.dtype) for s in segments] + [s.lora_b.to(x.dtype) for s in segments]
    method = _choose(backend, x, base_out.shape[-1], bounds)
    return _SegmentedLoRA.apply(x, base_out, bounds, scales, method, *weights)


def _choose(backend: str, x: torch.Tensor, out_features: int, bounds) -> str:
    if backend != "auto":
        return backend
    if x.is_cuda:
        return "triton"
    if len(bounds) < 2 or out_features > BMM_MAX_OUT_FEATURES:
        return "loop"
    grid = segment_grid(bounds, x.numel() // x.shape[-1])
    return "bmm" if grid.padding(sum(end - start for start, end in bounds)) <= padded_segments.MAX_PADDING else "loop"


class _SegmentedLoRA(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, base_out, bounds, scales, method, *weights):
        n = len(bounds)
        lora_as, lora_bs = weights[:n], weights[n:]
        x2 = x.reshape(-1, x.shape[-1])
        out2 = base_out.view(-1, base_out.shape[-1])
        # `saved`: what each method's backward reuses (v, or the stacked weights and v)
        if method == "triton":
            saved = _triton_forward(x2, out2, bounds, scales, lora_as, lora_bs)
        elif method == "bmm":
            saved = padded_segments.forward_(x2, out2, segment_grid(bounds, x2.shape[0]), scales, lora_as, lora_bs)
        else:
            saved = []
            for (start, end), a, b, scale in zip(bounds, lora_as, lora_bs, scales):
                v = segment_ops.shrink(x2, a, slice(start, end))
                segment_ops.expand_(out2, v, b, slice(start, end), scale)  # in place: out can be vocab wide
                saved.append(v)
        ctx.mark_dirty(base_out)
        ctx.bounds, ctx.scales, ctx.method, ctx.x_shape = bounds, scales, method, x.shape
        ctx.ranks = [a.shape[0] for a in lora_as]
        ctx.save_for_backward(x2, *lora_as, *lora_bs, *saved)
        return base_out

    @staticmethod
    def backward(ctx, grad_out):
        bounds, scales = ctx.bounds, ctx.scales
        n = len(bounds)
        saved = ctx.saved_tensors
        x2, lora_as, lora_bs, extra = saved[0], saved[1 : 1 + n], saved[1 + n : 1 + 2 * n], saved[1 + 2 * n :]
        g2 = grad_out.reshape(-1, grad_out.shape[-1])
        need_dx = ctx.needs_input_grad[0]
        if ctx.method == "triton":
            dx, grad_as, grad_bs = _triton_backward(x2, g2, lora_as, lora_bs, extra, need_dx)
        elif ctx.method == "bmm":
            grid = segment_grid(bounds, x2.shape[0])
            dx, grad_as, grad_bs = padded_segments.backward(g2, grid, extra, ctx.ranks, need_dx)
        else:
            dx = _zeros_outside(x2, bounds) if need_dx else None
            grad_as, grad_bs = [], []
            for (start, end), a, b, v, scale in zip(bounds, lora_as, lora_bs, extra, scales):
                g = g2[start:end]
                # scale the small [tokens, rank] / [out, rank] products, never the [tokens, out] gradient
                dv = (g @ b).mul_(scale)
                grad_bs.append((g.t() @ v).mul_(scale))
                grad_as.append(dv.t() @ x2[start:end])
                if need_dx:
                    torch.mm(dv, a, out=dx[start:end])
        dx = dx.view(ctx.x_shape) if need_dx else None
        return (dx, grad_out, None, None, None, *grad_as, *grad_bs)


def _zeros_outside(x2: torch.Tensor, bounds) -> torch.Tensor:
    """An uninitialised tensor like x2 whose rows outside every segment are zero."""
    out = torch.empty_like(x2)
    previous_end = 0
    for start, end in bounds:
        out[previous_end:start] = 0
        previous_end = end
    out[previous_end:] = 0
    return out


# --- GPU backend: Triton SGMV kernels over rank-padded stacked weights -------------------------


def _segment_tensors(bounds, scales, device):
    starts = torch.tensor([b[0] for b in bounds], dtype=torch.int64, device=device)
    ends = torch.tensor([b[1] for b in bounds], dtype=torch.int64, device=device)
    scale = torch.tensor(scales, dtype=torch.float32, device=device)
    return starts, ends, scale


def _triton_forward(x2, out2, bounds, scales, lora_as, lora_bs):
    from workers.sgmv import triton_kernels as tk

    starts, ends, scale = _segment_tensors(bounds, scales, x2.device)
    stacked_a = stack_padded(lora_as, rank_dim=0)  # [S, R, in]
    stacked_b = stack_padded(lora_bs, rank_dim=1)  # [S, out, R]
    v = tk.sgmv_shrink(x2, stacked_a, starts, ends)
    tk.sgmv_expand(v, stacked_b, starts, ends, scale, out=out2, accumulate=True)
    return [v, stacked_a, stacked_b, starts, ends, scale]


def _triton_backward(x2, g2, lora_as, lora_bs, saved, need_dx):
    from workers.sgmv import triton_kernels as tk

    v, stacked_a, stacked_b, starts, ends, scale = saved
    dv = tk.sgmv_shrink(g2, stacked_b.transpose(1, 2), starts, ends, scale)
    dx = tk.sgmv_expand(dv, stacked_a.transpose(1, 2), starts, ends) if need_dx else None
    stacked_grad_a = tk.sgmv_weight_grad(dv, x2, starts, ends)
    stacked_grad_b = tk.sgmv_weight_grad(g2, v, starts, ends, scale)
    grad_as = [stacked_grad_a[i, : a.shape[0]].to(a.dtype) for i, a in enumerate(lora_as)]
    grad_bs = [stacked_grad_b[i, :, : b.shape[1]].to(b.dtype) for i, b in enumerate(lora_bs)]
    return dx, grad_as, grad_bs

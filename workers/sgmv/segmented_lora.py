"""The LoRA delta of many adapters over packed tokens, as autograd functions.

Tokens are packed so that each adapter owns one contiguous row range (a segment). For segment s
with adapter weights A_s [r_s, in], B_s [out, r_s] and scale s_s:

    forward   v   = x_s @ A_s^T                 (shrink)
              y_s += s_s * v @ B_s^T            (expand, added into the base output in place)
    backward  g   = s_s * dY_s
              dV  = g @ B_s                     (a shrink)
              dX_s = dV @ A_s                   (an expand)
              dB_s = g^T @ v,  dA_s = dV^T @ x_s (per-segment reductions over tokens)

Two entry points:
- `apply_segmented_lora`: one layer's delta, added into a base output computed elsewhere (every
  backend, the GPU's included);
- `apply_lora_group`: the base outputs and LoRA deltas of the layers that read one input (an
  attention block's q/k/v, an MLP's gate/up, or one layer alone) as one autograd node, on CPU.
  The segment loop shrinks over the layers' concatenated A's in one matmul (the bmm path keeps
  one per layer, see padded_segments.py), and the input gradient is one sum built in place:
  a single adapter's LoRA overhead on SmolLM2 fell by a fifth to a third (README, Benchmarks).

Backends of the segment math:
- "loop": a segment loop of plain torch matmuls (it performs the same matmuls as peft, so
  results match peft bit for bit or nearly so);
- "bmm": one batched matmul per product over segments padded to a common width (CPU; see
  padded_segments.py), which saves the per-call overhead that dominates small segments;
- "triton": Triton SGMV kernels over rank-padded stacked weights (GPU; `apply_segmented_lora`).
"auto" picks Triton for GPU tensors; on CPU, bmm for several segments unless their padding
would double the rows or the layer is vocabulary-wide (lm_head, where the loop's in-place
update saves [tokens, vocab] temporaries and per-call overhead is negligible), else the loop.
Rows outside every segment get no delta.

A segment may name where its weight gradients go (`grad_a`, `grad_b`: the trainer passes each
adapter's `.grad` views of one flat tensor). They are then added there, in the matmul itself where
the loop computes them, and autograd gets None for those weights: no gradient tensor of its own,
no AccumulateGrad copy or add, and the adapter's gradients stay in their flat tensor.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from workers.sgmv import padded_segments, segment_ops
from workers.sgmv.padded_segments import segment_grid, stack_padded


@dataclass(frozen=True)
class Segment:
    start: int
    end: int
    lora_a: torch.Tensor  # [rank, in_features]
    lora_b: torch.Tensor  # [out_features, rank]
    scale: float
    grad_a: torch.Tensor | None = None  # if given, dA is added in here instead of returned to autograd
    grad_b: torch.Tensor | None = None  # likewise dB


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
    dests = tuple(s.grad_a for s in segments) + tuple(s.grad_b for s in segments)
    method = _choose(backend, x, base_out.shape[-1], bounds)
    return _SegmentedLoRA.apply(x, base_out, bounds, scales, method, dests, *weights)


def _choose(backend: str, x: torch.Tensor, out_features: int, bounds) -> str:
    if backend != "auto":
        return backend
    if x.is_cuda:
        return "triton"
    if len(bounds) < 2 or out_features > BMM_MAX_OUT_FEATURES:
        return "loop"
    return "bmm" if padded_segments.paying_grid(bounds, x.numel() // x.shape[-1]) is not None else "loop"


class _SegmentedLoRA(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, base_out, bounds, scales, method, dests, *weights):
        n = len(bounds)
        lora_as, lora_bs = weights[:n], weights[n:]
        x2 = x.reshape(-1, x.shape[-1])
        out2 = base_out.view(-1, base_out.shape[-1])
        # `saved`: what each method's backward reuses (v, or the stacked weights and v)
        if method == "triton":
            saved = _triton_forward(x2, out2, bounds, scales, lora_as, lora_bs)
        else:
            saved = _cpu_forward_(method, x2, [out2], bounds, scales, [lora_as], [lora_bs])
        ctx.mark_dirty(base_out)
        ctx.bounds, ctx.scales, ctx.method, ctx.x_shape, ctx.dests = bounds, scales, method, x.shape, dests
        ctx.ranks = [a.shape[0] for a in lora_as]
        ctx.save_for_backward(x2, *lora_as, *lora_bs, *saved)
        return base_out

    @staticmethod
    def backward(ctx, grad_out):
        n = len(ctx.bounds)
        saved = ctx.saved_tensors
        x2, lora_as, lora_bs, extra = saved[0], saved[1 : 1 + n], saved[1 + n : 1 + 2 * n], saved[1 + 2 * n :]
        g2 = grad_out.reshape(-1, grad_out.shape[-1])
        need_dx = ctx.needs_input_grad[0]
        if ctx.method == "triton":
            dx, grad_as, grad_bs = _triton_backward(x2, g2, lora_as, lora_bs, extra, need_dx)
        else:
            dx = torch.zeros_like(x2) if need_dx else None
            (grad_as,), (grad_bs,) = _cpu_backward_(ctx.method, x2, [g2], dx, ctx.bounds, ctx.scales, extra,
                                                    [lora_bs], ctx.ranks, [ctx.dests[n:]])
        dx = dx.view(ctx.x_shape) if need_dx else None
        return (dx, grad_out, None, None, None, None, *_deliver([*grad_as, *grad_bs], ctx.dests))


def apply_lora_group(
    x: torch.Tensor, layers: list[torch.nn.Linear], segments: list[list[Segment]], backend: str = "auto"
) -> list[torch.Tensor]:
    """[layer(x) + its LoRA delta for each layer and its segments], as one autograd node (CPU
    backends only). Every layer's segments must cover the same rows with the same adapters (so the
    same rank and scale per segment); the base layers are frozen (they get no gradient)."""
    bounds = tuple((s.start, s.end) for s in segments[0])
    if not bounds or any(tuple((s.start, s.end) for s in segs) != bounds for segs in segments):
        raise ValueError("every layer of a LoRA group needs the same, non-empty segments")
    scales = tuple(s.scale for s in segments[0])
    method = _choose(backend, x, max(layer.out_features for layer in layers), bounds)
    if method == "triton":
        raise ValueError("LoRA groups run on the CPU backends; on GPU use apply_segmented_lora per layer")
    weights = [s.lora_a.to(x.dtype) for segs in segments for s in segs]
    weights += [s.lora_b.to(x.dtype) for segs in segments for s in segs]
    dests = tuple(s.grad_a for segs in segments for s in segs) + tuple(s.grad_b for segs in segments for s in segs)
    bases = tuple((layer.weight, layer.bias) for layer in layers)
    return list(_LoRAGroup.apply(x, bases, bounds, scales, method, dests, *weights))


class _LoRAGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, bases, bounds, scales, method, dests, *weights):
        half = len(weights) // 2
        lora_as, lora_bs = _by_layer(weights[:half], len(bounds)), _by_layer(weights[half:], len(bounds))
        x2 = x.reshape(-1, x.shape[-1])
        outs = [F.linear(x2, weight, bias) for weight, bias in bases]
        saved = _cpu_forward_(method, x2, outs, bounds, scales, lora_as, lora_bs)
        ctx.bases, ctx.bounds, ctx.scales, ctx.method, ctx.x_shape = bases, bounds, scales, method, x.shape
        ctx.dests = dests
        ctx.ranks = [a.shape[0] for a in lora_as[0]]
        ctx.save_for_backward(x2, *weights[half:], *saved)
        return tuple(out.view(*x.shape[:-1], out.shape[-1]) for out in outs)

    @staticmethod
    def backward(ctx, *grad_outs):
        n_b = len(ctx.bases) * len(ctx.bounds)
        x2, lora_bs, extra = ctx.saved_tensors[0], ctx.saved_tensors[1 : 1 + n_b], ctx.saved_tensors[1 + n_b :]
        gs = [g.reshape(-1, g.shape[-1]) for g in grad_outs]
        dx = base_input_grad(gs, ctx.bases) if ctx.needs_input_grad[0] else None
        n_a = len(ctx.dests) // 2
        grad_as, grad_bs = _cpu_backward_(ctx.method, x2, gs, dx, ctx.bounds, ctx.scales, extra,
                                          _by_layer(lora_bs, len(ctx.bounds)), ctx.ranks,
                                          _by_layer(ctx.dests[n_a:], len(ctx.bounds)))
        dx = dx.view(ctx.x_shape) if dx is not None else None
        flat = [g for layer in grad_as for g in layer] + [g for layer in grad_bs for g in layer]
        return (dx, None, None, None, None, None, *_deliver(flat, ctx.dests))


def base_input_grad(gs: list[torch.Tensor], bases) -> torch.Tensor:
    """The frozen base layers' part of dX: the sum of g_i @ W_i, built in place."""
    dx = None
    for g, (weight, _) in zip(gs, bases):
        dx = g @ weight if dx is None else dx.addmm_(g, weight)
    return dx


def _by_layer(flat, n_segments: int) -> list[tuple]:
    """[every layer's matrices, segment after segment] -> one tuple per layer."""
    return [tuple(flat[i : i + n_segments]) for i in range(0, len(flat), n_segments)]


def _deliver(grads: list, dests: tuple) -> list:
    """The weight gradients for autograd: each one with a destination is added there instead (and
    autograd gets None); one already added there by the backward (None) stays None."""
    pairs = [(dest, grad) for grad, dest in zip(grads, dests) if dest is not None and grad is not None]
    if pairs:  # one call: the bmm path hands over a dA and a dB per layer and segment
        torch._foreach_add_(*map(list, zip(*pairs)))
    return [None if dest is not None else grad for grad, dest in zip(grads, dests)]


# --- CPU backends, over the layers of a group (one layer for apply_segmented_lora) --------------


def _cpu_forward_(method, x2, outs, bounds, scales, lora_as, lora_bs) -> list[torch.Tensor]:
    """outs[i] += layer i's LoRA delta, in place; returns the tensors the backward reuses."""
    if method == "bmm":
        return padded_segments.forward_(x2, outs, segment_grid(bounds, x2.shape[0]), scales, lora_as, lora_bs)
    saved = []
    for s, ((start, end), scale) in enumerate(zip(bounds, scales)):
        a_cat = _concat([a[s] for a in lora_as], dim=0)
        v = segment_ops.shrink(x2, a_cat, slice(start, end))  # [rows, layers * rank]
        for out, b, v_layer in zip(outs, lora_bs, v.chunk(len(outs), dim=1)):
            segment_ops.expand_(out, v_layer, b[s], slice(start, end), scale)  # in place: out can be vocab wide
        saved += [a_cat, v]
    return saved


def _cpu_backward_(method, x2, gs, dx, bounds, scales, saved, lora_bs, ranks, grad_b_dests):
    """Adds the LoRA part of dX into dx (unless None); returns dA and dB per layer and segment. The
    loop adds each dB with a destination (grad_b_dests, per layer and segment) into it in its matmul,
    and returns None for it."""
    if method == "bmm":
        return padded_segments.backward_(gs, dx, segment_grid(bounds, x2.shape[0]), saved, ranks)
    grad_as, grad_bs = [[] for _ in gs], [[] for _ in gs]
    for s, ((start, end), scale) in enumerate(zip(bounds, scales)):
        a_cat, v = saved[2 * s], saved[2 * s + 1]
        rows = [g[start:end] for g in gs]
        # scale the small [tokens, rank] / [out, rank] products, never the [tokens, out] gradient
        dv = _concat([g @ b[s] for g, b in zip(rows, lora_bs)], dim=1).mul_(scale)
        for i, (g, v_layer) in enumerate(zip(rows, v.chunk(len(gs), dim=1))):
            dest = grad_b_dests[i][s]
            if dest is None:
                grad_bs[i].append((g.t() @ v_layer).mul_(scale))
            else:  # accumulated in the matmul: no [out, rank] temporary, no scaling pass
                dest.addmm_(g.t(), v_layer, alpha=scale)
                grad_bs[i].append(None)
        for i, grad_a in enumerate((dv.t() @ x2[start:end]).chunk(len(gs), dim=0)):
            grad_as[i].append(grad_a)
        if dx is not None:
            dx[start:end].addmm_(dv, a_cat)
    return grad_as, grad_bs


def _concat(mats: list[torch.Tensor], dim: int) -> torch.Tensor:
    return mats[0] if len(mats) == 1 else torch.cat(mats, dim=dim)


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

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
  It shrinks over the layers' concatenated A's in one matmul, and the input gradient is one sum
  built in place: a single adapter's LoRA overhead on SmolLM2 fell by a fifth to a third.

Backends of the segment math:
- "loop": a segment loop of plain torch matmuls (the scale applied to v, so within rounding of
  peft's);
- "bmm": one batched matmul per product and rank over segments padded to a common width (CPU;
  see padded_segments.py), which saves the per-call overhead that dominates small segments. It
  gives every row the loop's bits (padded_segments.py says how), so the choice never shows;
- "triton": Triton SGMV kernels over rank-padded stacked weights (GPU; `apply_segmented_lora`).
"auto" picks Triton for GPU tensors; on CPU, bmm for several segments unless their padding
would double the rows or the layer is vocabulary-wide (lm_head, where the loop's in-place
update saves [tokens, vocab] temporaries and per-call overhead is negligible), else the loop.
Rows outside every segment get no delta.

A segment may name where its weight gradients go (`grad_a`, `grad_b`: the trainer passes each
adapter's `.grad` views of one flat tensor). They are then added there, one product per piece
of the segment (a request's rows) in order (grad_pieces.py), and autograd gets None for those
weights: no gradient tensor of its own, no AccumulateGrad copy or add, and the adapter's
gradients stay in their flat tensor. Without one, the pieces are added the same way from zero.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from workers.sgmv import padded_segments, row_gemm
from workers.sgmv.grad_pieces import Pieces, grad_pieces, whole_segments
from workers.sgmv.padded_segments import stack_padded


@dataclass(frozen=True)
class Segment:
    start: int
    end: int
    lora_a: torch.Tensor  # [rank, in_features]
    lora_b: torch.Tensor  # [out_features, rank]
    scale: float
    grad_a: torch.Tensor | None = None  # if given, dA is added in here instead of returned to autograd
    grad_b: torch.Tensor | None = None  # likewise dB
    # rows [start, end) of each request's piece of the segment, in order: its weight gradients add
    # each piece's product in turn (grad_pieces.py); () means one piece, the segment
    pieces: Pieces = ()


BACKENDS = ("auto", "loop", "bmm", "triton")
BMM_MAX_OUT_FEATURES = 16384  # wider outputs (an unembedding) take the loop under "auto"


def segment_pieces(segments: list[Segment]) -> tuple[Pieces, ...]:
    return tuple(s.pieces or whole_segments([(s.start, s.end)])[0] for s in segments)


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
    return _SegmentedLoRA.apply(x, base_out, bounds, scales, method, dests, segment_pieces(segments), *weights)


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
    def forward(ctx, x, base_out, bounds, scales, method, dests, pieces, *weights):
        n = len(bounds)
        lora_as, lora_bs = weights[:n], weights[n:]
        x2 = x.reshape(-1, x.shape[-1])
        out2 = base_out.view(-1, base_out.shape[-1])
        if method == "triton":
            saved = _triton_forward(x2, out2, bounds, scales, lora_as, lora_bs)
            ctx.save_for_backward(x2, *saved)
        else:
            ctx.classes = _cpu_forward_(method, x2, [out2], bounds, scales, [lora_as], [lora_bs])
            ctx.save_for_backward(x2)
        ctx.mark_dirty(base_out)
        ctx.bounds, ctx.method, ctx.x_shape, ctx.dests, ctx.pieces = bounds, method, x.shape, dests, pieces
        ctx.ranks = [a.shape[0] for a in lora_as]
        return base_out

    @staticmethod
    def backward(ctx, grad_out):
        n = len(ctx.bounds)
        x2, *saved = ctx.saved_tensors
        g2 = grad_out.reshape(-1, grad_out.shape[-1])
        need_dx = ctx.needs_input_grad[0]
        if ctx.method == "triton":
            dx, grads = _triton_backward(x2, g2, saved, need_dx, ctx.pieces, ctx.ranks, ctx.dests)
        else:
            dx = torch.zeros_like(x2) if need_dx else None
            (grad_as,), (grad_bs,) = _cpu_backward_(ctx.classes, x2, [g2], dx, ctx.pieces,
                                                    [ctx.dests[:n]], [ctx.dests[n:]])
            grads = [*grad_as, *grad_bs]
        dx = dx.view(ctx.x_shape) if need_dx else None
        return (dx, grad_out, None, None, None, None, None, *grads)


def apply_lora_group(
    x: torch.Tensor, layers: list[torch.nn.Linear], segments: list[list[Segment]], backend: str = "auto"
) -> list[torch.Tensor]:
    """[layer(x) + its LoRA delta for each layer and its segments], as one autograd node (CPU
    backends only). Every layer's segments must cover the same rows with the same adapters (so the
    same rank and scale per segment); the base layers are frozen (they get no gradient). With no
    segments it is the base layers alone, with the same input gradient (summed in place)."""
    bounds = tuple((s.start, s.end) for s in segments[0]) if segments else ()
    if any(tuple((s.start, s.end) for s in segs) != bounds for segs in segments):
        raise ValueError("every layer of a LoRA group needs the same segments")
    scales = tuple(s.scale for s in segments[0]) if segments else ()
    method = _choose(backend, x, max(layer.out_features for layer in layers), bounds) if bounds else "loop"
    if method == "triton":
        raise ValueError("LoRA groups run on the CPU backends; on GPU use apply_segmented_lora per layer")
    weights = [s.lora_a.to(x.dtype) for segs in segments for s in segs]
    weights += [s.lora_b.to(x.dtype) for segs in segments for s in segs]
    dests = tuple(s.grad_a for segs in segments for s in segs) + tuple(s.grad_b for segs in segments for s in segs)
    bases = tuple((layer.weight, layer.bias) for layer in layers)
    pieces = segment_pieces(segments[0]) if segments else ()
    return list(_LoRAGroup.apply(x, bases, bounds, scales, method, dests, pieces, *weights))


class _LoRAGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, bases, bounds, scales, method, dests, pieces, *weights):
        x2 = x.reshape(-1, x.shape[-1])
        outs = [F.linear(x2, weight, bias) for weight, bias in bases]
        ctx.classes = []
        if bounds:
            half = len(weights) // 2
            lora_as, lora_bs = _by_layer(weights[:half], len(bounds)), _by_layer(weights[half:], len(bounds))
            ctx.classes = _cpu_forward_(method, x2, outs, bounds, scales, lora_as, lora_bs)
        ctx.bases, ctx.bounds, ctx.x_shape, ctx.dests, ctx.pieces = bases, bounds, x.shape, dests, pieces
        ctx.save_for_backward(x2)
        return tuple(out.view(*x.shape[:-1], out.shape[-1]) for out in outs)

    @staticmethod
    def backward(ctx, *grad_outs):
        (x2,) = ctx.saved_tensors
        gs = [g.reshape(-1, g.shape[-1]) for g in grad_outs]
        dx = base_input_grad(gs, ctx.bases) if ctx.needs_input_grad[0] else None
        if not ctx.bounds:
            return (dx.view(ctx.x_shape) if dx is not None else None, None, None, None, None, None, None)
        n_a = len(ctx.dests) // 2
        grad_as, grad_bs = _cpu_backward_(ctx.classes, x2, gs, dx, ctx.pieces,
                                          _by_layer(ctx.dests[:n_a], len(ctx.bounds)),
                                          _by_layer(ctx.dests[n_a:], len(ctx.bounds)))
        dx = dx.view(ctx.x_shape) if dx is not None else None
        flat = [g for layer in grad_as for g in layer] + [g for layer in grad_bs for g in layer]
        return (dx, None, None, None, None, None, None, *flat)


def base_input_grad(gs: list[torch.Tensor], bases) -> torch.Tensor:
    """The frozen base layers' part of dX: the sum of g_i @ W_i, built in place."""
    dx = None
    for g, (weight, _) in zip(gs, bases):
        dx = g @ weight if dx is None else dx.addmm_(g, weight)
    return dx


def _by_layer(flat, n_segments: int) -> list[tuple]:
    """[every layer's matrices, segment after segment] -> one tuple per layer."""
    return [tuple(flat[i : i + n_segments]) for i in range(0, len(flat), n_segments)]


# --- CPU backends, over the layers of a group (one layer for apply_segmented_lora) --------------


@dataclass
class _RankClass:
    """The segments of one rank in a CPU LoRA node, computed together (bmm) or one by one (loop)."""

    rank: int
    width: int  # the rank its products are computed with (row_gemm.rank_width)
    members: list[int]  # segment indices
    bounds: list[tuple[int, int]]  # their rows
    grid: padded_segments.SegmentGrid | None  # the bmm grid; None: the segment loop
    a_cat: list[torch.Tensor]  # per member [layers * width, in] (loop), or one [G, layers * width, in] (bmm)
    bs: list[list[torch.Tensor]]  # per layer: per member [out, width] (loop), or one [G, out, width]
    scale: list[torch.Tensor]  # per member a scalar (loop), or one [G, 1, 1] (bmm)
    sv_rows: torch.Tensor | None = None  # [n_rows, layers * width] the scaled v of the class's rows


def _cpu_forward_(method, x2, outs, bounds, scales, lora_as, lora_bs) -> list[_RankClass]:
    """outs[i] += layer i's LoRA delta, in place; returns what the backward reuses, per rank class.

    Both methods compute the same products of the same shapes (padded_segments.py says why that
    gives the same bits): v = x A_cat^T over the layers' concatenated A's, scaled, then each
    layer's out += v_i B_i^T, added the way addmm adds."""
    classes = []
    for rank, members in _members_by_rank(lora_as[0]).items():
        width = row_gemm.rank_width(rank)
        a_cat = [_concat([_pad_rank(a[s], width, 0) for a in lora_as], dim=0) for s in members]
        bs = [[_pad_rank(b[s], width, 1) for s in members] for b in lora_bs]
        scale = [torch.tensor(scales[s], dtype=x2.dtype, device=x2.device) for s in members]
        grid = None
        if method == "bmm" and len(members) > 1:
            grid = padded_segments.segment_grid(tuple(bounds[s] for s in members), x2.shape[0], row_gemm.min_rows())
            a_cat, bs, scale = [torch.stack(a_cat)], [[torch.stack(b)] for b in bs], [torch.stack(scale).view(-1, 1, 1)]
        rank_class = _RankClass(rank, width, members, [bounds[s] for s in members], grid, a_cat, bs, scale)
        if grid is not None:
            rank_class.sv_rows = padded_segments.stacked_forward_(x2, outs, grid, scale[0], a_cat[0],
                                                                  [b[0] for b in bs])
        else:
            sv_rows = x2.new_empty(x2.shape[0], len(outs) * width)
            for m, s in enumerate(members):
                rows = slice(*bounds[s])
                if rows.start == rows.stop:
                    continue
                sv = row_gemm.mm(x2[rows], a_cat[m].t()).mul_(scale[m])  # [rows, layers * width]
                for out, b, sv_layer in zip(outs, bs, sv.chunk(len(outs), dim=1)):
                    row_gemm.addmm_(out[rows], sv_layer, b[m].t())  # in place: out can be vocab wide
                sv_rows[rows] = sv
            rank_class.sv_rows = sv_rows
        classes.append(rank_class)
    return classes


def _cpu_backward_(classes: list[_RankClass], x2, gs, dx, pieces, grad_a_dests, grad_b_dests):
    """Adds the LoRA part of dX into dx (unless None); adds every dA and dB into its destination
    (grad_*_dests, per layer and segment), piece by piece (grad_pieces.py), and returns None for it,
    or returns it where the segment names none (then summed the same way, from zero)."""
    n_segments = len(grad_a_dests[0])
    grad_as = [[None] * n_segments for _ in gs]
    grad_bs = [[None] * n_segments for _ in gs]
    for rank_class in classes:
        members, width = rank_class.members, rank_class.width
        if rank_class.grid is not None:
            dv_rows = padded_segments.stacked_backward_(gs, dx, rank_class.grid, rank_class.scale[0],
                                                        rank_class.a_cat[0], [b[0] for b in rank_class.bs])
        else:
            dv_rows = x2.new_empty(x2.shape[0], len(gs) * width)
            for m, s in enumerate(members):
                rows = slice(*rank_class.bounds[m])
                if rows.start == rows.stop:
                    continue
                dv = _concat([row_gemm.mm(g[rows], b[m]) for g, b in zip(gs, rank_class.bs)], dim=1)
                dv.mul_(rank_class.scale[m])  # scale the small [tokens, rank] product, never the [tokens, out] one
                if dx is not None:
                    row_gemm.addmm_(dx[rows], dv, rank_class.a_cat[m])
                dv_rows[rows] = dv
        fold = grad_pieces(tuple(pieces[s] for s in members))
        targets_a, targets_b = [], []
        for i, g in enumerate(gs):
            for dests, grads, targets, shape in (
                    (grad_a_dests[i], grad_as[i], targets_a, (rank_class.rank, x2.shape[1])),
                    (grad_b_dests[i], grad_bs[i], targets_b, (g.shape[1], rank_class.rank))):
                for s in members:
                    if dests[s] is None:  # autograd gets it: summed the same way, from zero
                        grads[s] = x2.new_zeros(shape)
                targets.append([dests[s] if dests[s] is not None else grads[s] for s in members])
        fold.fold_(padded_segments.weight_grad_families(fold, x2, gs, dv_rows, rank_class.sv_rows,
                                                        rank_class.rank, width, targets_a, targets_b))
    return grad_as, grad_bs


def _members_by_rank(lora_as) -> dict[int, list[int]]:
    """Segment indices grouped by rank, in order of first appearance."""
    members: dict[int, list[int]] = {}
    for s, a in enumerate(lora_as):
        members.setdefault(a.shape[0], []).append(s)
    return members


def _pad_rank(m: torch.Tensor, width: int, rank_dim: int) -> torch.Tensor:
    pad = width - m.shape[rank_dim]
    return m if pad == 0 else F.pad(m, (0, pad) if rank_dim == 1 else (0, 0, 0, pad))


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


def _triton_backward(x2, g2, saved, need_dx, pieces, ranks, dests):
    """dX, and each segment's dA and dB folded tile by tile into its destination (None for
    autograd then) or from zero (returned), in the fixed order of grad_pieces.py."""
    from workers.sgmv import triton_kernels as tk

    v, stacked_a, stacked_b, starts, ends, scale = saved
    dv = tk.sgmv_shrink(g2, stacked_b.transpose(1, 2), starts, ends, scale)
    dx = tk.sgmv_expand(dv, stacked_a.transpose(1, 2), starts, ends) if need_dx else None
    table = tk.piece_table(grad_pieces(pieces), x2.device)
    n = len(ranks)
    init_a = _fold_start(dests[:n], stacked_a.shape, x2.device)
    init_b = _fold_start(dests[n:], stacked_b.shape, x2.device)
    grad_a = tk.sgmv_weight_grad_pieces(dv, x2, table, init=init_a)  # [S, R, in], fp32
    grad_b = tk.sgmv_weight_grad_pieces(g2, v, table, scale, init=init_b)  # [S, out, R], fp32
    grads = [grad_a[i, :r] for i, r in enumerate(ranks)] + [grad_b[i, :, :r] for i, r in enumerate(ranks)]
    for dest, grad in zip(dests, grads):
        if dest is not None:
            dest.copy_(grad)
    return dx, [None if dest is not None else grad.to(x2.dtype) for dest, grad in zip(dests, grads)]


def _fold_start(dests, shape, device) -> torch.Tensor:
    """Where each segment's pieces are added from: its destination's values (zero-padded to the
    stacked rank), or zero."""
    start = torch.zeros(shape, dtype=torch.float32, device=device)
    for i, dest in enumerate(dests):
        if dest is not None:
            start[i, : dest.shape[0], : dest.shape[1]] = dest
    return start

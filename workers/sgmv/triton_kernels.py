"""Triton kernels for the segmented gather matmuls (SGMV) used by multi-tenant LoRA.

Semantics are defined by :mod:`workers.sgmv.reference` (same names and signatures):

* ``sgmv_shrink``      x [T, K] , w [S, R, K] -> [T, R]      (LoRA "A" side, R small)
* ``sgmv_expand``      v [T, R] , w [S, N, R] -> [T, N]      (LoRA "B" side, N large)
* ``sgmv_weight_grad`` left [T, M], right [T, P] -> [S, M, P] (per-segment X^T Y, fp32)

* ``sgmv_weight_grad_pieces`` the same per piece of a segment (a request's rows), each piece's
                           product added in turn to a start value (the gradient so far): what the
                           trainer uses

Launch layout: shrink/expand use grid (row blocks of the longest segment, column
blocks, segment); programs whose row block starts past their segment's end exit
immediately, which keeps ragged segments cheap without a per-row segment lookup.
weight_grad uses grid (M blocks, P blocks, segment) and loops over that segment's
tokens, so an empty segment simply stores zeros.

Batch invariance: every block size is a constant or follows only a layer's own dimensions,
never the batch (the longest segment, the largest rank of the pass): a row's shrink and expand
are the same dots whatever else the launch holds, and a rank padded to another adapter's adds
whole zero blocks of K (exact). Reductions over tokens never follow the batch either:
``sgmv_weight_grad_pieces`` reduces each piece (workers/sgmv/grad_pieces.py) in chunks of
GRAD_CHUNK_ROWS rows from its first row, and adds the pieces in order, so an adapter's gradient
does not depend on who else is in the launch or on where its rows sit.

All products accumulate in float32; fp32 inputs use ``input_precision="ieee"`` so
results match torch instead of TF32. Weights may have arbitrary strides (callers pass
transposed views), and so may the activations and ``out``.

CPU testing: with ``TRITON_INTERPRET=1`` set before this module is imported the
kernels run on CPU tensors under the Triton interpreter (slow; keep shapes small).
The interpreter's ``tl.dot`` multiplies raw bfloat16 bit patterns (it stores bf16 as
uint16; triton-lang/triton#11584), so under the interpreter the tiles are upcast to
fp32 before the dot. That is numerically equivalent to bf16 tensor-core MMA with an
fp32 accumulator, because the product of two bf16 values is exact in fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from workers.sgmv.grad_pieces import GradPieces
from workers.sgmv.reference import (
    SegmentInfo,
    check_expand_args,
    check_shrink_args,
    check_weight_grad_args,
)


# --------------------------------------------------------------------------- kernels


@triton.jit
def _dot_acc(acc, a, b, UPCAST: tl.constexpr):
    """acc += a @ b in fp32 (see module docstring for why UPCAST exists)."""
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    # input_precision only matters for fp32 operands: "ieee" avoids TF32 rounding.
    return tl.dot(a, b, acc, input_precision="ieee")


@triton.jit
def _sgmv_rows_kernel(
    x_ptr, w_ptr, out_ptr, seg_starts_ptr, seg_ends_ptr, scale_ptr,
    N, K,
    stride_xt, stride_xk,
    stride_ws, stride_wn, stride_wk,
    stride_ot, stride_on,
    HAS_SCALE: tl.constexpr,
    ACCUMULATE: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """out[rows of s, :N] (+)= scale[s] * x[rows of s, :K] @ w[s, :N, :K].T.

    Shared by shrink (N = R small, K large) and expand (N large, K = R small); the
    launchers choose block sizes that fit each shape.
    """
    # int64 so that seg * stride and row * stride cannot overflow for big S*N*K / T*N.
    seg = tl.program_id(2).to(tl.int64)
    seg_start = tl.load(seg_starts_ptr + seg)
    seg_end = tl.load(seg_ends_ptr + seg)
    row0 = seg_start + tl.program_id(0) * BLOCK_M
    # The grid is sized for the longest segment; shorter ones have idle blocks.
    if row0 >= seg_end:
        return

    rows = row0 + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < seg_end
    col_mask = cols < N

    x_rows = x_ptr + rows[:, None] * stride_xt
    # w[s] is read as a [BLOCK_K, BLOCK_N] tile, i.e. already transposed for the dot.
    w_cols = w_ptr + seg * stride_ws + cols[None, :] * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < K
        x_mask = row_mask[:, None] & k_mask[None, :]
        w_mask = k_mask[:, None] & col_mask[None, :]
        x = tl.load(x_rows + ks[None, :] * stride_xk, mask=x_mask, other=0.0)
        w = tl.load(w_cols + ks[:, None] * stride_wk, mask=w_mask, other=0.0)
        acc = _dot_acc(acc, x, w, UPCAST)

    if HAS_SCALE:
        acc = acc * tl.load(scale_ptr + seg)
    out_ptrs = out_ptr + rows[:, None] * stride_ot + cols[None, :] * stride_on
    out_mask = row_mask[:, None] & col_mask[None, :]
    if ACCUMULATE:
        acc += tl.load(out_ptrs, mask=out_mask, other=0.0).to(tl.float32)
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _rows_product(
    left_ptr, right_ptr, start, end, ms, ps, m_mask, p_mask,
    stride_lt, stride_lm, stride_rt, stride_rp,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    """left[start:end, ms].T @ right[start:end, ps] in float32, reduced BLOCK_T rows at a time from
    `start`: the trip count and order follow these rows only (no rows: the zero tile)."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for t0 in range(start, end, BLOCK_T):
        ts = t0 + tl.arange(0, BLOCK_T)
        t_mask = ts < end
        # Read left as a [BLOCK_M, BLOCK_T] tile so the dot needs no explicit transpose.
        lt = tl.load(
            left_ptr + ts[None, :] * stride_lt + ms[:, None] * stride_lm,
            mask=m_mask[:, None] & t_mask[None, :], other=0.0,
        )
        r = tl.load(
            right_ptr + ts[:, None] * stride_rt + ps[None, :] * stride_rp,
            mask=t_mask[:, None] & p_mask[None, :], other=0.0,
        )
        acc = _dot_acc(acc, lt, r, UPCAST)
    return acc


@triton.jit
def _sgmv_weight_grad_kernel(
    left_ptr, right_ptr, out_ptr, seg_starts_ptr, seg_ends_ptr, scale_ptr,
    M, P,
    stride_lt, stride_lm,
    stride_rt, stride_rp,
    stride_os, stride_om, stride_op,
    HAS_SCALE: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    """out[s, :M, :P] = scale[s] * left[rows of s].T @ right[rows of s]."""
    seg = tl.program_id(2).to(tl.int64)
    ms = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    ps = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = ms < M
    p_mask = ps < P
    # Ragged reduction: the trip count depends on this segment only (an empty one stores the zero tile).
    acc = _rows_product(left_ptr, right_ptr, tl.load(seg_starts_ptr + seg), tl.load(seg_ends_ptr + seg),
                        ms, ps, m_mask, p_mask, stride_lt, stride_lm, stride_rt, stride_rp,
                        UPCAST, BLOCK_M, BLOCK_N, BLOCK_T)
    if HAS_SCALE:
        acc = acc * tl.load(scale_ptr + seg)
    out_ptrs = out_ptr + seg * stride_os + ms[:, None] * stride_om + ps[None, :] * stride_op
    tl.store(out_ptrs, acc, mask=m_mask[:, None] & p_mask[None, :])


@triton.jit
def _sgmv_weight_grad_pieces_kernel(
    left_ptr, right_ptr, out_ptr, piece_starts_ptr, piece_ends_ptr, segment_pieces_ptr, scale_ptr,
    M, P,
    stride_lt, stride_lm,
    stride_rt, stride_rp,
    stride_os, stride_om, stride_op,
    HAS_SCALE: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    """out[s, :M, :P] += scale[s] * left[piece].T @ right[piece] for each piece of s, in turn.

    out holds the start value (the gradient so far) and takes the result. A piece's product is
    reduced on its own, BLOCK_T rows at a time from its first row, then added: the order is the
    piece's own, whatever else the launch holds."""
    seg = tl.program_id(2).to(tl.int64)
    first_piece = tl.load(segment_pieces_ptr + seg)
    end_piece = tl.load(segment_pieces_ptr + seg + 1)

    ms = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    ps = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = ms < M
    p_mask = ps < P
    out_ptrs = out_ptr + seg * stride_os + ms[:, None] * stride_om + ps[None, :] * stride_op
    out_mask = m_mask[:, None] & p_mask[None, :]
    acc = tl.load(out_ptrs, mask=out_mask, other=0.0)
    for piece in range(first_piece, end_piece):
        part = _rows_product(left_ptr, right_ptr, tl.load(piece_starts_ptr + piece), tl.load(piece_ends_ptr + piece),
                             ms, ps, m_mask, p_mask, stride_lt, stride_lm, stride_rt, stride_rp,
                             UPCAST, BLOCK_M, BLOCK_N, BLOCK_T)
        if HAS_SCALE:
            part = part * tl.load(scale_ptr + seg)
        acc += part
    tl.store(out_ptrs, acc, mask=out_mask)


# --------------------------------------------------------------------------- launchers

# Decided once at import: TRITON_INTERPRET is read when @triton.jit runs.
_INTERPRETED: bool = isinstance(_sgmv_rows_kernel, InterpretedFunction)


def _block(n: int, cap: int) -> int:
    """Power-of-two block covering ``n`` (tl.dot needs >= 16 per dim), capped at ``cap``."""
    return max(16, min(cap, triton.next_power_of_2(max(n, 1))))


# Block sizes never follow the batch (the longest segment, the largest rank): see the module
# docstring. Rows: 32 per program. Ranks (<= 64 in one block) are padded to whole blocks of 16.
ROW_BLOCK = 32
RANK_BLOCK = 16
GRAD_CHUNK_ROWS = 32  # rows per step of a piece's reduction in sgmv_weight_grad_pieces


def _shrink_blocks(k: int) -> tuple[int, int, int]:
    # R <= 64 fits one column block, so x is streamed from memory exactly once.
    return ROW_BLOCK, 64, _block(k, 64)


def _expand_blocks(n: int) -> tuple[int, int, int]:
    # N is large (vocab-sized): 128-wide column tiles; R is looped in chunks of 16 (zero padding
    # to a longer R adds whole zero chunks, which leave the sum as it was).
    return ROW_BLOCK, _block(n, 128), RANK_BLOCK


def _launch_weight_grad(kernel, left: torch.Tensor, right: torch.Tensor, out: torch.Tensor,
                        tables: tuple[torch.Tensor, ...], scale: torch.Tensor | None) -> None:
    """`kernel` over grid (M blocks, P blocks, segment) of out [S, M, P]; `tables`: its row tables."""
    num_segments, m, p = out.shape
    block_m, block_n, block_t = 32, 64, GRAD_CHUNK_ROWS  # constants: never the batch's shape
    grid = (triton.cdiv(m, block_m), triton.cdiv(p, block_n), num_segments)
    if 0 in grid:
        return
    kernel[grid](
        left, right, out, *tables, _scale_arg(scale, tables[0]),
        m, p,
        left.stride(0), left.stride(1),
        right.stride(0), right.stride(1),
        out.stride(0), out.stride(1), out.stride(2),
        HAS_SCALE=scale is not None,
        UPCAST=_INTERPRETED,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_T=block_t,
    )


def _check_launchable(t: torch.Tensor) -> None:
    if t.device.type == "cpu" and not _INTERPRETED:
        raise ValueError(
            "CPU tensors need the Triton interpreter: set TRITON_INTERPRET=1 before "
            "importing workers.sgmv.triton_kernels (or pass CUDA tensors)"
        )


def _scale_arg(scale: torch.Tensor | None, dummy: torch.Tensor) -> torch.Tensor:
    # The kernel never reads the pointer when HAS_SCALE is False, but it needs one.
    return dummy if scale is None else scale.contiguous()


def _launch_rows(
    a: torch.Tensor,
    w: torch.Tensor,
    out: torch.Tensor,
    seg_starts: torch.Tensor,
    seg_ends: torch.Tensor,
    scale: torch.Tensor | None,
    info: SegmentInfo,
    blocks: tuple[int, int, int],
    accumulate: bool,
) -> None:
    num_segments, n, k = w.shape
    block_m, block_n, block_k = blocks
    grid = (triton.cdiv(info.max_len, block_m), triton.cdiv(n, block_n), num_segments)
    if 0 in grid:
        return  # nothing to compute; out already holds the right contents
    starts = seg_starts.contiguous()
    _sgmv_rows_kernel[grid](
        a, w, out, starts, seg_ends.contiguous(), _scale_arg(scale, starts),
        n, k,
        a.stride(0), a.stride(1),
        w.stride(0), w.stride(1), w.stride(2),
        out.stride(0), out.stride(1),
        HAS_SCALE=scale is not None,
        ACCUMULATE=accumulate,
        UPCAST=_INTERPRETED,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
    )


def _new_output(rows: int, cols: int, like: torch.Tensor, info: SegmentInfo) -> torch.Tensor:
    # Kernels only write segment rows; gap rows must be zero, so zero-fill only if any exist.
    if info.covers_all_rows:
        return torch.empty(rows, cols, dtype=like.dtype, device=like.device)
    return torch.zeros(rows, cols, dtype=like.dtype, device=like.device)


def sgmv_shrink(
    x: torch.Tensor,
    w: torch.Tensor,
    seg_starts: torch.Tensor,
    seg_ends: torch.Tensor,
    scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """out[rows of s] = scale[s] * x[rows of s] @ w[s].T; x [T, K], w [S, R, K] -> [T, R].

    The output has x.dtype; rows outside every segment are zero.
    """
    info = check_shrink_args(x, w, seg_starts, seg_ends, scale)
    _check_launchable(x)
    out = _new_output(x.shape[0], w.shape[1], x, info)
    blocks = _shrink_blocks(w.shape[2])
    _launch_rows(x, w, out, seg_starts, seg_ends, scale, info, blocks, accumulate=False)
    return out


def sgmv_expand(
    v: torch.Tensor,
    w: torch.Tensor,
    seg_starts: torch.Tensor,
    seg_ends: torch.Tensor,
    scale: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    accumulate: bool = False,
) -> torch.Tensor:
    """out[rows of s] (+)= scale[s] * v[rows of s] @ w[s].T; v [T, R], w [S, N, R] -> [T, N].

    Without ``out`` a [T, N] tensor in v.dtype is allocated (gap rows zero). A given
    ``out`` may be float32 or bfloat16 with any strides; without ``accumulate`` its gap
    rows are zeroed, with ``accumulate`` they are left untouched.
    """
    info = check_expand_args(v, w, seg_starts, seg_ends, scale, out)
    _check_launchable(v)
    if out is None:
        out = _new_output(v.shape[0], w.shape[1], v, info)
    elif not accumulate and not info.covers_all_rows:
        out.zero_()
    blocks = _expand_blocks(w.shape[1])
    _launch_rows(v, w, out, seg_starts, seg_ends, scale, info, blocks, accumulate=accumulate)
    return out


def sgmv_weight_grad(
    left: torch.Tensor,
    right: torch.Tensor,
    seg_starts: torch.Tensor,
    seg_ends: torch.Tensor,
    scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """out[s] = scale[s] * left[rows of s].T @ right[rows of s]; -> [S, M, P] float32."""
    info = check_weight_grad_args(left, right, seg_starts, seg_ends, scale)
    _check_launchable(left)
    num_segments, m, p = seg_starts.shape[0], left.shape[1], right.shape[1]
    # Every (segment, M, P) element is written by the grid, empty segments included.
    out = torch.empty(num_segments, m, p, dtype=torch.float32, device=left.device)
    _launch_weight_grad(_sgmv_weight_grad_kernel, left, right, out, (seg_starts.contiguous(), seg_ends.contiguous()),
                        scale)
    return out


def piece_table(pieces: GradPieces, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(piece starts, piece ends, each segment's first piece and one past its last) of `pieces`,
    in the order each segment adds them."""
    offsets = [0]
    for n in pieces.per_segment:
        offsets.append(offsets[-1] + n)
    return (torch.tensor([start for start, _ in pieces.spans], dtype=torch.int64, device=device),
            torch.tensor([end for _, end in pieces.spans], dtype=torch.int64, device=device),
            torch.tensor(offsets, dtype=torch.int64, device=device))


def sgmv_weight_grad_pieces(
    left: torch.Tensor,
    right: torch.Tensor,
    table: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    scale: torch.Tensor | None = None,
    init: torch.Tensor | None = None,
) -> torch.Tensor:
    """out[s] = init[s] + scale[s] * left[piece].T @ right[piece], piece after piece of segment s
    in order (`piece_table`); -> [S, M, P] float32 (init is zero when None; it is updated in place
    when float32 and contiguous)."""
    tile_starts, tile_ends, segment_tiles = table
    if left.shape[0] != right.shape[0]:
        raise ValueError(f"left and right need the same number of rows, got {left.shape[0]} and {right.shape[0]}")
    _check_launchable(left)
    num_segments, m, p = segment_tiles.shape[0] - 1, left.shape[1], right.shape[1]
    if init is None:
        out = torch.zeros(num_segments, m, p, dtype=torch.float32, device=left.device)
    else:
        out = init if init.dtype == torch.float32 and init.is_contiguous() else init.float().contiguous()
    _launch_weight_grad(_sgmv_weight_grad_pieces_kernel, left, right, out, (tile_starts, tile_ends, segment_tiles),
                        scale)
    return out

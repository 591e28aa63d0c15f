"""Plain-torch reference implementations of the SGMV ops, plus shared argument checks.

SGMV = segmented gather matrix-vector/matrix multiply. Tokens of many tenants are
packed into one [T, *] matrix; segment ``s`` owns the contiguous row range
``[seg_starts[s], seg_ends[s])`` and uses the weight slice ``w[s]``. Segments are
ascending and non-overlapping, may be empty, and may leave gap rows between them.

* ``sgmv_shrink``:      out[rows of s]  = scale[s] * x[rows of s] @ w[s].T       -> [T, R]
* ``sgmv_expand``:      out[rows of s] (+)= scale[s] * v[rows of s] @ w[s].T     -> [T, N]
* ``sgmv_weight_grad``: out[s] = scale[s] * left[rows of s].T @ right[rows of s] -> [S, M, P]

Rows outside every segment are zero in the output of shrink/expand (expand with
``accumulate=True`` leaves them untouched). All math is done in float32 and cast to
the output dtype at the end, exactly like the Triton kernels, so the two can be
compared tightly. These loops are meant to be obviously correct, not fast.

The ``check_*`` helpers are shared with :mod:`workers.sgmv.triton_kernels` so that
both backends reject the same bad input with the same ``ValueError``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SUPPORTED_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16)


@dataclass(frozen=True)
class SegmentInfo:
    """Host-side facts about the segment table, needed to size grids and outputs."""

    max_len: int
    """Length of the longest segment (0 if all are empty or there are none)."""
    covers_all_rows: bool
    """True when the segments tile [0, T) with no gap rows, so outputs need no zero-fill."""


def _check_tensor(
    name: str, t: object, ndim: int, device: torch.device | None = None
) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device} (same device as the data)")
    return t


def _check_float(name: str, t: torch.Tensor) -> None:
    if t.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"{name} has dtype {t.dtype}, supported: float32, bfloat16")


def check_segments(
    seg_starts: torch.Tensor,
    seg_ends: torch.Tensor,
    num_segments: int,
    num_rows: int,
    device: torch.device,
) -> SegmentInfo:
    """Validate the segment table against S weight slices and T rows.

    This copies the (small) table to the host once; the launch needs the longest
    segment length there anyway to size the grid.
    """
    _check_tensor("seg_starts", seg_starts, 1, device)
    _check_tensor("seg_ends", seg_ends, 1, device)
    for name, t in (("seg_starts", seg_starts), ("seg_ends", seg_ends)):
        if t.dtype != torch.int64:
            raise ValueError(f"{name} must be int64, got {t.dtype}")
        if t.shape[0] != num_segments:
            raise ValueError(
                f"{name} has {t.shape[0]} entries but the weights hold {num_segments} segments"
            )
    if num_segments == 0:
        return SegmentInfo(max_len=0, covers_all_rows=num_rows == 0)

    starts, ends = torch.stack([seg_starts, seg_ends]).cpu()
    lengths = ends - starts
    if bool((starts < 0).any()) or bool((ends > num_rows).any()):
        raise ValueError(f"segment bounds must lie in [0, {num_rows}] (T = number of rows)")
    if bool((lengths < 0).any()):
        raise ValueError("every segment needs seg_starts[s] <= seg_ends[s]")
    if bool((starts[1:] < ends[:-1]).any()):
        raise ValueError("segments must be ascending and non-overlapping")
    total = int(lengths.sum())
    return SegmentInfo(max_len=int(lengths.max()), covers_all_rows=total == num_rows)


def check_scale(scale: torch.Tensor | None, num_segments: int, device: torch.device) -> None:
    """``scale`` is either None (meaning 1) or a float32 [S] tensor."""
    if scale is None:
        return
    _check_tensor("scale", scale, 1, device)
    if scale.dtype != torch.float32:
        raise ValueError(f"scale must be float32, got {scale.dtype}")
    if scale.shape[0] != num_segments:
        raise ValueError(f"scale has {scale.shape[0]} entries, expected {num_segments}")


def check_shrink_args(
    x: torch.Tensor,
    w: torch.Tensor,
    seg_starts: torch.Tensor,
    seg_ends: torch.Tensor,
    scale: torch.Tensor | None,
) -> SegmentInfo:
    """Validate ``sgmv_shrink`` inputs: x [T, K], w [S, R, K]."""
    _check_tensor("x", x, 2)
    _check_tensor("w", w, 3, x.device)
    _check_float("x", x)
    if w.dtype != x.dtype:
        raise ValueError(f"w dtype {w.dtype} does not match x dtype {x.dtype}")
    if w.shape[2] != x.shape[1]:
        raise ValueError(f"w is [S, R, K] = {tuple(w.shape)} but x is [T, K] = {tuple(x.shape)}")
    check_scale(scale, w.shape[0], x.device)
    return check_segments(seg_starts, seg_ends, w.shape[0], x.shape[0], x.device)


def check_expand_args(
    v: torch.Tensor,
    w: torch.Tensor,
    seg_starts: torch.Tensor,
    seg_ends: torch.Tensor,
    scale: torch.Tensor | None,
    out: torch.Tensor | None,
) -> SegmentInfo:
    """Validate ``sgmv_expand`` inputs: v [T, R], w [S, N, R], out [T, N] or None."""
    _check_tensor("v", v, 2)
    _check_tensor("w", w, 3, v.device)
    _check_float("v", v)
    if w.dtype != v.dtype:
        raise ValueError(f"w dtype {w.dtype} does not match v dtype {v.dtype}")
    if w.shape[2] != v.shape[1]:
        raise ValueError(f"w is [S, N, R] = {tuple(w.shape)} but v is [T, R] = {tuple(v.shape)}")
    if out is not None:
        _check_tensor("out", out, 2, v.device)
        _check_float("out", out)
        if tuple(out.shape) != (v.shape[0], w.shape[1]):
            raise ValueError(
                f"out has shape {tuple(out.shape)}, expected [T, N] = {(v.shape[0], w.shape[1])}"
            )
    check_scale(scale, w.shape[0], v.device)
    return check_segments(seg_starts, seg_ends, w.shape[0], v.shape[0], v.device)


def check_weight_grad_args(
    left: torch.Tensor,
    right: torch.Tensor,
    seg_starts: torch.Tensor,
    seg_ends: torch.Tensor,
    scale: torch.Tensor | None,
) -> SegmentInfo:
    """Validate ``sgmv_weight_grad`` inputs: left [T, M], right [T, P]."""
    _check_tensor("left", left, 2)
    _check_tensor("right", right, 2, left.device)
    _check_float("left", left)
    if right.dtype != left.dtype:
        raise ValueError(f"right dtype {right.dtype} does not match left dtype {left.dtype}")
    if right.shape[0] != left.shape[0]:
        raise ValueError(
            f"left and right need the same number of rows, got {left.shape[0]} and {right.shape[0]}"
        )
    # Unlike shrink/expand there is no weight tensor, so the table itself defines S.
    num_segments = _check_tensor("seg_starts", seg_starts, 1, left.device).shape[0]
    check_scale(scale, num_segments, left.device)
    return check_segments(seg_starts, seg_ends, num_segments, left.shape[0], left.device)


def _segment_bounds(seg_starts: torch.Tensor, seg_ends: torch.Tensor) -> list[tuple[int, int]]:
    return list(zip(seg_starts.tolist(), seg_ends.tolist()))


def _scale_of(scale: torch.Tensor | None, s: int) -> torch.Tensor | float:
    return 1.0 if scale is None else scale[s]


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
    check_shrink_args(x, w, seg_starts, seg_ends, scale)
    out = torch.zeros(x.shape[0], w.shape[1], dtype=x.dtype, device=x.device)
    for s, (a, b) in enumerate(_segment_bounds(seg_starts, seg_ends)):
        acc = x[a:b].float() @ w[s].float().T
        out[a:b] = (acc * _scale_of(scale, s)).to(out.dtype)
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

    Without ``out`` a zero [T, N] tensor in v.dtype is allocated. Without ``accumulate``
    the rows of ``out`` outside every segment are zeroed, so the result never depends
    on what ``out`` held before.
    """
    check_expand_args(v, w, seg_starts, seg_ends, scale, out)
    if out is None:
        out = torch.zeros(v.shape[0], w.shape[1], dtype=v.dtype, device=v.device)
    elif not accumulate:
        out.zero_()
    for s, (a, b) in enumerate(_segment_bounds(seg_starts, seg_ends)):
        acc = (v[a:b].float() @ w[s].float().T) * _scale_of(scale, s)
        if accumulate:
            acc = acc + out[a:b].float()
        out[a:b] = acc.to(out.dtype)
    return out


def sgmv_weight_grad(
    left: torch.Tensor,
    right: torch.Tensor,
    seg_starts: torch.Tensor,
    seg_ends: torch.Tensor,
    scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """out[s] = scale[s] * left[rows of s].T @ right[rows of s]; -> [S, M, P] float32."""
    check_weight_grad_args(left, right, seg_starts, seg_ends, scale)
    num_segments = seg_starts.shape[0]
    out = torch.zeros(
        num_segments, left.shape[1], right.shape[1], dtype=torch.float32, device=left.device
    )
    for s, (a, b) in enumerate(_segment_bounds(seg_starts, seg_ends)):
        out[s] = (left[a:b].float().T @ right[a:b].float()) * _scale_of(scale, s)
    return out

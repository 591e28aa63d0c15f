"""Tests for the SGMV Triton kernels against the plain-torch reference.

Without a GPU the kernels run under the Triton interpreter on CPU tensors, which costs
about a millisecond per program instance, so every shape here is deliberately small.
On a CUDA machine the same tests exercise the compiled kernels.
"""

from __future__ import annotations

import pytest
import torch

from workers.sgmv import reference as ref
from workers.sgmv import triton_kernels as tk  # runs under the interpreter without a GPU: see tests/conftest.py

pytestmark = pytest.mark.gpu
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = [torch.float32, torch.bfloat16]

# T = 96 rows. Gaps at rows 0-2, 18-19, 90-91; segment 1 is empty; segment 3 is longer
# than one 64-row block, so the shorter segments exercise the early exit of extra blocks.
T_ROWS = 96
STARTS = [3, 10, 10, 20, 92]
ENDS = [10, 10, 18, 90, 96]
NUM_SEGS = len(STARTS)
GAPS = [(0, 3), (18, 20), (90, 92)]


def _segments(
    starts: list[int] = STARTS, ends: list[int] = ENDS
) -> tuple[torch.Tensor, torch.Tensor]:
    return (
        torch.tensor(starts, dtype=torch.int64, device=DEVICE),
        torch.tensor(ends, dtype=torch.int64, device=DEVICE),
    )


def _randn(*shape: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(*shape, generator=gen).to(device=DEVICE, dtype=dtype)


def _weights(
    s: int, rows: int, cols: int, dtype: torch.dtype, transposed: bool, gen: torch.Generator
) -> torch.Tensor:
    """[s, rows, cols] weights, optionally as a non-contiguous transposed view."""
    if transposed:
        return _randn(s, cols, rows, dtype=dtype, gen=gen).transpose(1, 2)
    return _randn(s, rows, cols, dtype=dtype, gen=gen)


def _scale(with_scale: bool, gen: torch.Generator) -> torch.Tensor | None:
    if not with_scale:
        return None
    # Includes a negative and a zero multiplier.
    s = torch.rand(NUM_SEGS, generator=gen) * 2.0 + 0.25
    s[0], s[2] = -s[0], 0.0
    return s.to(DEVICE)


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert actual.dtype == expected.dtype
    assert actual.shape == expected.shape
    if dtype == torch.float32:
        # fp32 sums over K <= 200 in the kernels' block order vs torch's: a few 1e-6 apart, and the
        # interpreter's tl.dot (numpy's BLAS) moves with the numpy build: 1.1e-5 seen on numpy 2.3.5
        torch.testing.assert_close(actual, expected, rtol=3e-5, atol=3e-5)
    else:
        # bf16 outputs may differ by one bf16 ulp (<= 2^-7 relative) where fp32 sums
        # accumulated in a different order round to different neighbours.
        torch.testing.assert_close(actual.float(), expected.float(), rtol=1.6e-2, atol=1e-2)


def _assert_gaps_zero(out: torch.Tensor) -> None:
    for lo, hi in GAPS:
        assert not out[lo:hi].any(), f"gap rows {lo}:{hi} must be zero"


# --------------------------------------------------------------------------- shrink


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_scale", [False, True])
@pytest.mark.parametrize(
    "rank,k,transposed", [(4, 48, True), (8, 72, False), (16, 96, True), (16, 200, True)]
)
def test_shrink_matches_reference(
    dtype: torch.dtype, with_scale: bool, rank: int, k: int, transposed: bool
) -> None:
    gen = torch.Generator().manual_seed(rank * 1000 + k)
    starts, ends = _segments()
    x = _randn(T_ROWS, k, dtype=dtype, gen=gen)
    w = _weights(NUM_SEGS, rank, k, dtype, transposed, gen)
    scale = _scale(with_scale, gen)

    out = tk.sgmv_shrink(x, w, starts, ends, scale)
    expected = ref.sgmv_shrink(x, w, starts, ends, scale)

    assert out.dtype == dtype
    _assert_close(out, expected, dtype)
    _assert_gaps_zero(out)


# --------------------------------------------------------------------------- expand


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_scale", [False, True])
@pytest.mark.parametrize("rank,n,transposed", [(4, 48, True), (8, 90, True), (16, 160, False)])
def test_expand_matches_reference(
    dtype: torch.dtype, with_scale: bool, rank: int, n: int, transposed: bool
) -> None:
    gen = torch.Generator().manual_seed(rank * 1000 + n)
    starts, ends = _segments()
    v = _randn(T_ROWS, rank, dtype=dtype, gen=gen)
    w = _weights(NUM_SEGS, n, rank, dtype, transposed, gen)
    scale = _scale(with_scale, gen)

    out = tk.sgmv_expand(v, w, starts, ends, scale)
    expected = ref.sgmv_expand(v, w, starts, ends, scale)

    assert out.dtype == dtype
    _assert_close(out, expected, dtype)
    _assert_gaps_zero(out)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("out_dtype", DTYPES)
def test_expand_accumulate_into_out(dtype: torch.dtype, out_dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(7)
    starts, ends = _segments()
    v = _randn(T_ROWS, 8, dtype=dtype, gen=gen)
    w = _weights(NUM_SEGS, 72, 8, dtype, True, gen)
    scale = _scale(True, gen)
    base = _randn(T_ROWS, 72, dtype=out_dtype, gen=gen)

    out = base.clone()
    result = tk.sgmv_expand(v, w, starts, ends, scale, out=out, accumulate=True)
    expected = ref.sgmv_expand(v, w, starts, ends, scale, out=base.clone(), accumulate=True)

    assert result is out
    _assert_close(out, expected, out_dtype)
    # Gap rows keep their previous contents when accumulating.
    for lo, hi in GAPS:
        assert torch.equal(out[lo:hi], base[lo:hi])


def test_expand_overwrites_strided_out_and_zeroes_gaps() -> None:
    gen = torch.Generator().manual_seed(8)
    starts, ends = _segments()
    v = _randn(T_ROWS, 4, dtype=torch.float32, gen=gen)
    w = _weights(NUM_SEGS, 50, 4, torch.float32, True, gen)
    # A column slice of a wider buffer checks that out's strides are honoured.
    storage = torch.full((T_ROWS, 64), 3.0, device=DEVICE)
    out = storage[:, 7:57]

    tk.sgmv_expand(v, w, starts, ends, out=out)
    expected = ref.sgmv_expand(v, w, starts, ends)

    _assert_close(out, expected, torch.float32)
    assert (storage[:, :7] == 3.0).all() and (storage[:, 57:] == 3.0).all()


def test_segments_covering_all_rows() -> None:
    # No gap rows: outputs are allocated uninitialised, so every row must be written.
    gen = torch.Generator().manual_seed(9)
    starts, ends = _segments([0, 20, 20], [20, 20, 50])
    x = _randn(50, 40, dtype=torch.float32, gen=gen)
    w = _randn(3, 8, 40, dtype=torch.float32, gen=gen)
    _assert_close(
        tk.sgmv_shrink(x, w, starts, ends), ref.sgmv_shrink(x, w, starts, ends), torch.float32
    )

    v = _randn(50, 8, dtype=torch.float32, gen=gen)
    wb = _randn(3, 40, 8, dtype=torch.float32, gen=gen)
    out = torch.full((50, 40), float("nan"), device=DEVICE)
    tk.sgmv_expand(v, wb, starts, ends, out=out)
    _assert_close(out, ref.sgmv_expand(v, wb, starts, ends), torch.float32)


def test_all_segments_empty() -> None:
    starts, ends = _segments([0, 5], [0, 5])
    ones = lambda *shape: torch.ones(*shape, device=DEVICE)  # noqa: E731
    assert not tk.sgmv_shrink(ones(8, 32), ones(2, 4, 32), starts, ends).any()
    assert not tk.sgmv_expand(ones(8, 4), ones(2, 32, 4), starts, ends).any()
    grad = tk.sgmv_weight_grad(ones(8, 32), ones(8, 4), starts, ends)
    assert grad.shape == (2, 32, 4) and not grad.any()


# --------------------------------------------------------------------------- weight grad


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_scale", [False, True])
@pytest.mark.parametrize("m,p", [(8, 72), (90, 4), (16, 48)])
def test_weight_grad_matches_reference(
    dtype: torch.dtype, with_scale: bool, m: int, p: int
) -> None:
    gen = torch.Generator().manual_seed(m * 1000 + p)
    starts, ends = _segments()
    left = _randn(T_ROWS, m, dtype=dtype, gen=gen)
    right = _randn(T_ROWS, p, dtype=dtype, gen=gen)
    scale = _scale(with_scale, gen)

    out = tk.sgmv_weight_grad(left, right, starts, ends, scale)
    expected = ref.sgmv_weight_grad(left, right, starts, ends, scale)

    assert out.dtype == torch.float32 and out.shape == (NUM_SEGS, m, p)
    # Products of bf16 values are exact in fp32, so only the summation order differs.
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-4)
    assert not out[1].any()  # the empty segment


# --------------------------------------------------------------------------- LoRA identity


def _lora_autograd(
    x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, dy: torch.Tensor, scale: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """y = scale * (x @ A^T) @ B^T per segment, and its gradients from torch autograd (fp32)."""
    # detach(): .float() is a no-op on fp32 inputs and must not flag the caller's tensors.
    x, a, b = (t.detach().float().requires_grad_() for t in (x, a, b))
    y = torch.zeros(x.shape[0], b.shape[1], device=DEVICE)
    for s, (lo, hi) in enumerate(zip(STARTS, ENDS)):
        y[lo:hi] = scale[s] * (x[lo:hi] @ a[s].T) @ b[s].T
    (y * dy.float()).sum().backward()
    return y.detach(), x.grad, a.grad, b.grad


@pytest.mark.parametrize("dtype", DTYPES)
def test_lora_forward_backward_identity(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(1234)
    starts, ends = _segments()
    k, n, rank = 72, 90, 8
    x = _randn(T_ROWS, k, dtype=dtype, gen=gen)
    a = _randn(NUM_SEGS, rank, k, dtype=dtype, gen=gen)  # A: [S, R, K]
    b = _randn(NUM_SEGS, n, rank, dtype=dtype, gen=gen)  # B: [S, N, R]
    dy = _randn(T_ROWS, n, dtype=dtype, gen=gen)
    scale = _scale(True, gen)

    v = tk.sgmv_shrink(x, a, starts, ends)
    y = tk.sgmv_expand(v, b, starts, ends, scale)
    dv = tk.sgmv_shrink(dy, b.transpose(1, 2), starts, ends, scale)
    dx = tk.sgmv_expand(dv, a.transpose(1, 2), starts, ends)
    da = tk.sgmv_weight_grad(dv, x, starts, ends)
    db = tk.sgmv_weight_grad(dy, v, starts, ends, scale)

    pairs = zip(("y", "dx", "da", "db"), (y, dx, da, db), _lora_autograd(x, a, b, dy, scale))
    for name, got, want in pairs:
        if dtype == torch.float32:
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4, msg=name)
        else:
            # v and dV are rounded to bf16 between kernels while autograd stays in fp32.
            err = (got.float() - want).abs().max()
            assert err <= 2e-2 * want.abs().max(), f"{name}: max error {err}"
    assert not da[1].any() and not db[1].any()


# --------------------------------------------------------------------------- validation


def test_rejects_bad_arguments() -> None:
    starts, ends = _segments()
    x = torch.zeros(T_ROWS, 32, device=DEVICE)
    w = torch.zeros(NUM_SEGS, 4, 32, device=DEVICE)

    def bad_table(s: list[int], e: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        return _segments(s, e)

    with pytest.raises(ValueError, match="does not match x dtype"):
        tk.sgmv_shrink(x, w.bfloat16(), starts, ends)
    with pytest.raises(ValueError, match="float32, bfloat16"):
        tk.sgmv_shrink(x.half(), w.half(), starts, ends)
    with pytest.raises(ValueError, match=r"\[S, R, K\]"):
        tk.sgmv_shrink(x, torch.zeros(NUM_SEGS, 4, 31, device=DEVICE), starts, ends)
    with pytest.raises(ValueError, match="int64"):
        tk.sgmv_shrink(x, w, starts.int(), ends.int())
    with pytest.raises(ValueError, match="segments"):
        tk.sgmv_shrink(x, w[:3], starts, ends)
    with pytest.raises(ValueError, match="non-overlapping"):
        tk.sgmv_shrink(x, w, *bad_table([0, 5, 9, 20, 30], [10, 8, 12, 25, 40]))
    with pytest.raises(ValueError, match="seg_starts"):
        tk.sgmv_shrink(x, w, *bad_table([0, 5, 9, 20, 30], [4, 4, 12, 25, 40]))
    with pytest.raises(ValueError, match="bounds"):
        tk.sgmv_shrink(x, w, *bad_table([0, 5, 9, 20, 30], [4, 8, 12, 25, T_ROWS + 1]))
    with pytest.raises(ValueError, match="scale has"):
        tk.sgmv_shrink(x, w, starts, ends, torch.ones(NUM_SEGS - 1, device=DEVICE))
    with pytest.raises(ValueError, match="scale must be float32"):
        tk.sgmv_shrink(x, w, starts, ends, torch.ones(NUM_SEGS, device=DEVICE).double())
    with pytest.raises(ValueError, match="out has shape"):
        tk.sgmv_expand(
            torch.zeros(T_ROWS, 4, device=DEVICE), w.transpose(1, 2), starts, ends,
            out=torch.zeros(T_ROWS, 33, device=DEVICE),
        )
    with pytest.raises(ValueError, match="same number of rows"):
        tk.sgmv_weight_grad(x, torch.zeros(T_ROWS - 1, 4, device=DEVICE), starts, ends)
    with pytest.raises(ValueError, match="is on"):
        tk.sgmv_shrink(x, w.to("meta"), starts, ends)

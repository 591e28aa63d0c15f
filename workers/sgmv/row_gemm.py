"""GEMMs whose rows come out with the same bits however many rows they are computed with.

Batch invariance needs each token row's result to depend on that row alone. MKL's sgemm gives
it for most shapes, with two exceptions (measured on torch 2.13's MKL 2024.2, AVX512, for every
product the trainer computes: base layers, LoRA shrink, expand, dV, dX; tests/workers/trainer/
test_batch_invariance.py probes them):
- few rows: M <= 3 takes other kernels (gemv for M = 1), and on T threads MKL cuts the rows into
  per-thread blocks, a block of fewer than 4 rows again taking another kernel (on 2 threads
  M in {5..7, 9..11} differ; on 16, M up to 27). From `min_rows()` rows on, every row gets the
  bits it gets in a 600-row product, on 1 and on 2 threads alike;
- a width of 1: an output (or reduction) of one column is a gemv whose blocking follows M.
  `rank_width` pads a rank-1 adapter's products to 2 columns (a zero row of A, zero column of B).
So a product over fewer than `min_rows()` rows is computed on rows padded with zeros, and its
real rows kept. On CPUs where MKL's default path also splits the reduction by M (AMX machines:
workers/__init__.py), its strict reproducibility mode, which the package switches on, gives every
row count the same bits; the padding stays for the machines measured above and a user's own
MKL_CBWR.
"""

from __future__ import annotations

import torch


def min_rows(threads: int | None = None) -> int:
    """Rows from which a product's rows do not depend on the row count, on `threads` intra-op
    threads (default: the calling thread's)."""
    threads = torch.get_num_threads() if threads is None else threads
    return 4 if threads <= 1 else max(16, 4 * threads)


def rank_width(rank: int) -> int:
    """Columns a rank-`rank` adapter's products are computed with (rank 1 is padded to 2)."""
    return max(rank, 2)


def padded_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    """x [n, f] with zero rows appended up to `rows` (x itself when it has that many)."""
    if x.shape[0] >= rows:
        return x
    out = x.new_zeros(rows, x.shape[1])
    out[: x.shape[0]] = x
    return out


def mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b, each row with the bits of a large product."""
    n, need = a.shape[0], min_rows()
    return a @ b if n >= need else (padded_rows(a, need) @ b)[:n]


def addmm_(c: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """c += a @ b in place (addmm semantics: MKL adds into c), each row with the bits of a large product."""
    n, need = a.shape[0], min_rows()
    if n >= need:
        c.addmm_(a, b)
    else:
        padded = padded_rows(c, need).addmm_(padded_rows(a, need), b)
        c.copy_(padded[:n])

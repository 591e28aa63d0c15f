"""The calling thread's intra-op thread count on CPU, set without touching other threads'.

`torch.set_num_threads` is process-wide (it also sets MKL's global count and clears oneDNN's
caches), and once vLLM runs in the process it is a no-op: vLLM replaces it after binding its own
OpenMP threads to cores. `intra_op_threads` instead sets the two per-thread knobs torch's CPU ops
follow: OpenMP's thread count of the calling thread (`at::parallel_for` asks
`omp_get_max_threads`) and MKL's thread-local count (its GEMMs). A knob this torch build lacks
(no MKL, another OpenMP runtime) is left alone.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch


def _torch_cpu_library() -> ctypes.CDLL | None:
    try:  # its symbols resolve through its dependencies too (libgomp)
        return ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"))
    except OSError:
        return None


_LIB = _torch_cpu_library()
_omp_set_num_threads = getattr(_LIB, "omp_set_num_threads", None)
_omp_get_max_threads = getattr(_LIB, "omp_get_max_threads", None)
_mkl_set_num_threads_local = getattr(_LIB, "MKL_Set_Num_Threads_Local", None)  # the C API (by value)
_mkl_get_max_threads = getattr(_LIB, "MKL_Get_Max_Threads", None)


def available() -> bool:
    return _omp_set_num_threads is not None and _omp_get_max_threads is not None


def current() -> tuple[int, int | None]:
    """(OpenMP, MKL) threads an op started on this thread would use; MKL None without MKL."""
    omp = torch.get_num_threads()  # = omp_get_max_threads() where torch uses OpenMP
    return omp, (_mkl_get_max_threads() if _mkl_get_max_threads else None)


@contextmanager
def intra_op_threads(n: int | None) -> Iterator[None]:
    """Run the block with `n` intra-op threads on this thread (None: unchanged)."""
    if n is None or not available():
        yield
        return
    torch.get_num_threads()  # this thread's lazy OpenMP set-up first: it would overwrite our count
    omp_before = _omp_get_max_threads()
    _omp_set_num_threads(n)
    mkl_before = _mkl_set_num_threads_local(n) if _mkl_set_num_threads_local else None
    try:
        yield
    finally:
        _omp_set_num_threads(omp_before)
        if mkl_before is not None:
            _mkl_set_num_threads_local(mkl_before)  # 0: back to MKL's process-wide count

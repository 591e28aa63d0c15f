"""Keep freed host memory in the process, so each pass reuses warm pages instead of faulting in new ones.

A trainer pass allocates and frees the same large CPU tensors every time (SmolLM2's [tokens, vocab]
logits and their gradient are 50 MB at 256 tokens). glibc malloc hands such blocks back to the
kernel on free (mmap above its threshold, heap trimming, per-thread arenas' small heaps), so the
next pass faults every page in again, zero-filled by the kernel: ~90,000 page faults per SmolLM2
pass of 8 x 32 tokens, 5-12% of its time on 2 cores.

`retain_freed_host_memory()` tells glibc to keep it: blocks below 1 GiB come from the heap, the
heap is not trimmed below 2 GiB of free top, and every thread uses the main arena (the arenas of
other threads are heaps of at most 64 MiB, whose larger blocks are always mmapped). The cost is
that the process keeps its peak heap; a trainer's is bounded by its pass size. Call it early:
threads that allocated before it keep their own arenas. The trainer engine calls it when it is
created, unless the process's settings opt out (Settings.keep_glibc_malloc_defaults).
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform

log = logging.getLogger(__name__)

# mallopt(3) parameters
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8

MMAP_THRESHOLD = 1 << 30
TRIM_THRESHOLD = (1 << 31) - 1  # mallopt takes an int

_applied = False


def retain_freed_host_memory(keep_glibc_defaults: bool = False) -> bool:
    """Tune glibc malloc as above, once per process; False where it does not apply (not glibc,
    `keep_glibc_defaults`, or the user set MALLOC_* variables: glibc's own, read as it reads them)."""
    global _applied
    if _applied:
        return True
    if platform.libc_ver()[0] != "glibc" or keep_glibc_defaults:
        return False
    if any(k.startswith("MALLOC_") for k in os.environ) or "GLIBC_TUNABLES" in os.environ:
        return False  # the user tuned malloc already
    libc = ctypes.CDLL(None)
    ok = all(libc.mallopt(param, value) == 1 for param, value in (
        (M_ARENA_MAX, 1), (M_MMAP_THRESHOLD, MMAP_THRESHOLD), (M_TRIM_THRESHOLD, TRIM_THRESHOLD)))
    if not ok:
        log.warning("mallopt refused a setting; freed host memory may still go back to the kernel")
    _applied = ok
    return ok

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

A trainer that pages runs in and out (workers/trainer/residency.py) frees a run's tensors and the
copies written for it in no pattern a pass has: kept, those holes grew the heap past the memory
budget (an embedded SmolLM2 server with a 6 GiB budget reached 14 GiB of RSS over 1,000 runs).
`release_freed_host_memory()` hands the heap's free pages back (glibc's malloc_trim), at most once
every few seconds; the executor calls it after it pages runs out.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
import time

log = logging.getLogger(__name__)

# mallopt(3) parameters
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8

MMAP_THRESHOLD = 1 << 30
TRIM_THRESHOLD = (1 << 31) - 1  # mallopt takes an int

_applied = False
RELEASE_EVERY_SECONDS = 5.0
_released_at = -RELEASE_EVERY_SECONDS


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


def release_freed_host_memory() -> bool:
    """Give the heap's free pages back to the kernel (malloc_trim: the free top, and whole free pages inside
    the heap), unless it was done within RELEASE_EVERY_SECONDS; whether it ran. glibc only."""
    global _released_at
    now = time.monotonic()
    if now - _released_at < RELEASE_EVERY_SECONDS or platform.libc_ver()[0] != "glibc":
        return False
    _released_at = now
    ctypes.CDLL(None).malloc_trim(0)
    return True

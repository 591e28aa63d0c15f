"""The malloc settings of workers/host_memory.py take effect in the process, once, and only where
asked for. What they buy (page faults and RSS of SmolLM2 passes, with and without them) is a
benchmark, not a test: benchmarks/host_memory.py.

Each case runs in a fresh interpreter without torch, so glibc's state is known: it allocates one
64 MiB block with malloc and frees it, and reads glibc's own account (mallinfo2) of where the block
was. glibc's defaults serve a block that large by mmap and unmap it on free; the settings serve it
from the heap and keep it there.
"""

import json
import os
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc malloc tuning")

PROGRAM = """
import ctypes, json
from service.settings import Settings
from workers.host_memory import retain_freed_host_memory

FIELDS = ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")
class Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in FIELDS]
libc = ctypes.CDLL(None)
libc.mallinfo2.restype = Mallinfo2
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]

keep = Settings().keep_glibc_malloc_defaults  # as the processes that run a trainer read it
tuned = retain_freed_host_memory(keep)
libc.malloc_trim(0)  # the imports' free space at the heap's top would hold part of the block
before = libc.mallinfo2()
block = libc.malloc(64 << 20)
held = libc.mallinfo2()
libc.free(block)
after = libc.mallinfo2()
print(json.dumps({"tuned": tuned, "again": retain_freed_host_memory(keep),
                  "mmapped": held.hblkhd - before.hblkhd, "heap_kept": after.arena - before.arena}))
"""
BLOCK = 64 << 20


def run(**env: str) -> dict:
    base = {k: v for k, v in os.environ.items()
            if not k.startswith("MALLOC_") and k not in ("GLIBC_TUNABLES", "LORAPLEX_KEEP_GLIBC_MALLOC_DEFAULTS")}
    out = subprocess.run([sys.executable, "-c", PROGRAM], capture_output=True, text=True, check=True, env=base | env)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_settings_keep_a_large_freed_block_in_the_heap():
    report = run()
    assert report["tuned"] and report["again"]
    assert report["mmapped"] == 0, "a 64 MiB block was still mmapped"
    assert report["heap_kept"] >= BLOCK, "the heap was trimmed after the free"


def test_opting_out_leaves_glibcs_defaults():
    assert_defaults(run(LORAPLEX_KEEP_GLIBC_MALLOC_DEFAULTS="1"))


@pytest.mark.parametrize("env", [{"MALLOC_ARENA_MAX": "2"}, {"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=0"}],
                         ids=["MALLOC_-variable", "GLIBC_TUNABLES"])
def test_the_users_own_malloc_settings_are_left_alone(env):
    assert_defaults(run(**env))


def assert_defaults(report: dict) -> None:
    assert not report["tuned"] and not report["again"]
    assert report["mmapped"] >= BLOCK  # glibc's default: a block this large is mmapped, and unmapped on free
    assert report["heap_kept"] < BLOCK


RELEASE = """
import ctypes, json, os
from workers.host_memory import release_freed_host_memory, retain_freed_host_memory

libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
page = os.sysconf("SC_PAGE_SIZE")
def rss():
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * page

assert retain_freed_host_memory()
block = libc.malloc(64 << 20)
ctypes.memset(block, 1, 64 << 20)  # touched: resident
pin = libc.malloc(4096)  # above it: the heap's top cannot shrink past it, only pages inside can go back
libc.free(block)
kept = rss()
released = release_freed_host_memory()
print(json.dumps({"released": released, "again": release_freed_host_memory(), "freed": kept - rss()}))
"""


def test_release_hands_a_freed_block_inside_the_heap_back_at_most_every_few_seconds():
    out = subprocess.run([sys.executable, "-c", RELEASE], capture_output=True, text=True, check=True)
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["released"] and not report["again"]  # the second call came within RELEASE_EVERY_SECONDS
    assert report["freed"] >= BLOCK * 3 // 4, report

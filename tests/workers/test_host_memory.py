"""Freed host memory stays in the trainer's process: warm passes stop faulting pages in, and the
process does not grow from pass to pass.

Each case runs in a fresh interpreter, so glibc's state is known (this process's threads already
have their arenas). The passes run on a thread other than the main one, like the scheduler thread
that runs the embedded trainer; SmolLM2's [tokens, vocab] logits are above glibc's mmap threshold.
"""

import json
import os
import platform
import statistics
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc malloc tuning")

PROGRAM = """
import json, resource, threading, psutil, torch
from workers.trainer.adapters import AdamParams
from workers.trainer.batch import Datum, ForwardBackwardInput
from workers.trainer.engine import TrainerEngine
from workers.host_memory import retain_freed_host_memory

engine = TrainerEngine("SmolLM2-135M-Instruct")
engine.create_adapter("a")
ids = torch.randint(0, engine.vocab_size, (257,), generator=torch.Generator().manual_seed(0))
datum = Datum(ids[:-1], {"target_tokens": ids[1:], "weights": torch.ones(256)})
report = {"tuned": retain_freed_host_memory(), "faults": [], "rss_mb": []}

def passes():
    for _ in range(8):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        engine.forward_backward([ForwardBackwardInput("a", [datum])])
        engine.optim_step([("a", AdamParams())])
        report["faults"].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
        report["rss_mb"].append(psutil.Process().memory_info().rss / 2**20)

thread = threading.Thread(target=passes)
thread.start()
thread.join()
print(json.dumps(report))
"""


def run_passes(**env) -> dict:
    base = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    out = subprocess.run([sys.executable, "-c", PROGRAM], capture_output=True, text=True, check=True,
                         env=base | env)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_warm_passes_reuse_freed_memory_without_growing():
    glibc_defaults = run_passes(LORAPLEX_KEEP_GLIBC_MALLOC_DEFAULTS="1")
    tuned = run_passes()
    assert not glibc_defaults["tuned"] and tuned["tuned"]
    # glibc's defaults give the logits back to the kernel on free: every pass faults them in again
    assert min(glibc_defaults["faults"][2:]) > 20_000
    # (a few thousand, not 0: on these VMs DAMON pages idle memory out, e.g. [1203, 1926, 1351, 6,
    # 1546, 6] in one CI run)
    assert statistics.median(tuned["faults"][2:]) < 5_000, tuned["faults"]
    rss = tuned["rss_mb"]
    # The kept memory is reused, not added to. Not to the byte: glibc sometimes cannot fit a freed
    # [256, vocab] fp32 block (48 MB) back in its hole, and the heap takes one more. In 60 passes
    # it grew by two such blocks by pass 11 and then stayed flat for 49 passes. Over 8 passes, growth
    # of 62-106 MB was seen, and a bound of 100 MB failed in two CI runs (103 and ~105 MB). A leak
    # of one block per pass would add five or more blocks here.
    logits_mb = 256 * 49152 * 4 / 2**20
    assert rss[-1] - rss[2] < 3 * logits_mb, rss

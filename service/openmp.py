"""Keep OpenMP workers spinning briefly between parallel regions when trainer and sampler share a process.

torch on CPU runs its ops on libgomp thread teams, one team per thread that calls into torch.
In embedded mode the trainer (scheduler thread) and the vLLM sampler (its engine thread) each
have a team, so the process manages more OpenMP threads than it has CPUs. libgomp then
"throttles" its spin-wait to 100 spins: an idle worker sleeps almost at once, and every parallel
region pays a futex wake-up. The sampler's LoRA ops are many small ops per layer and suffer most:
on 2 cores (SmolLM2, fp32, 8 adapters x 4 prompts), with a trainer team beside it, a LoRA layer
call took 1.2 ms instead of 0.44 ms and mixed sampling ran at 67-73 tok/s instead of 134.

OMP_WAIT_POLICY=ACTIVE raises the throttled spin to 1,000. GOMP_SPINCOUNT bounds the unthrottled
spin at ~1 ms (ACTIVE alone spins 5 minutes: an idle team then keeps a core busy, and sampling
stayed at 73 tok/s). libgomp reads both once, when it is loaded: this must run before torch is
imported (or preloaded), so `serve` reads its settings (Settings.keep_openmp_defaults, the opt-out)
and calls this before it imports anything that loads torch. README ("Sampling") has the end-to-end figures.
"""

from __future__ import annotations

import logging
import os
import sys

log = logging.getLogger(__name__)

SPIN_SETTINGS = {"OMP_WAIT_POLICY": "ACTIVE", "GOMP_SPINCOUNT": "100000"}


def spin_between_parallel_regions(keep_openmp_defaults: bool = False) -> bool:
    """Set SPIN_SETTINGS for this process and its children; False where it does not apply: libgomp
    already loaded (too late), `keep_openmp_defaults` (the opt-out), or the user set either variable."""
    if keep_openmp_defaults or any(name in os.environ for name in SPIN_SETTINGS):
        return False
    if openmp_runtime_loaded():
        log.warning("OpenMP spin settings not applied: libgomp was loaded first (torch imported, or LD_PRELOAD); "
                    "set %s yourself", " ".join(f"{k}={v}" for k, v in SPIN_SETTINGS.items()))
        return False
    os.environ.update(SPIN_SETTINGS)
    return True


def openmp_runtime_loaded() -> bool:
    """Whether libgomp is already in this process: it read its settings when it was loaded. vLLM on
    CPU puts torch's libgomp in LD_PRELOAD, so children of a process running vLLM load it first."""
    try:
        with open("/proc/self/maps") as maps:
            return any("libgomp" in line for line in maps)
    except OSError:  # not Linux
        return "torch" in sys.modules

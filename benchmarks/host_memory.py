"""What keeping freed host memory in the trainer's process buys (workers/host_memory.py).

The same SmolLM2 training passes (one tenant, forward_backward of 256 tokens + optim_step) run in a
fresh interpreter twice per repetition, interleaved:
    defaults   glibc's malloc defaults (LORAPLEX_KEEP_GLIBC_MALLOC_DEFAULTS=1)
    tuned      the trainer's settings: one arena, no mmap below 1 GiB, no trimming
Each process runs its passes on a thread other than the main one, like the scheduler thread that
runs the embedded trainer, and counts per pass: minor page faults, wall time, RSS after it. The
first two passes warm up and are left out of the medians. SmolLM2's [tokens, vocab] logits (48 MB
at 256 tokens) are above glibc's mmap threshold, so with the defaults each pass maps them again.

    .venv/bin/python -m benchmarks.host_memory [--passes 10] [--reps 2] [--no-write]

Results go to benchmarks/results/host_memory.md; only the ratios are meaningful.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import typer

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "host_memory.md"
MODEL, TOKENS, WARMUP = "SmolLM2-135M-Instruct", 256, 2

PROGRAM = """
import json, resource, sys, threading, time, psutil, torch
from loraplex.types import AdamParams
from service.settings import Settings
from workers.host_memory import retain_freed_host_memory
from workers.trainer.engine import TrainerEngine
from contract.inputs import EngineDatum, ForwardBackwardInput

model, tokens, passes = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
keep = Settings().keep_glibc_malloc_defaults
engine = TrainerEngine(model, keep_glibc_malloc_defaults=keep)  # applies the settings first, unless opted out
engine.create_adapter("a")
ids = torch.randint(0, engine.vocab_size, (tokens + 1,), generator=torch.Generator().manual_seed(0))
datum = EngineDatum(ids[:-1], {"target_tokens": ids[1:], "weights": torch.ones(tokens)})
report = {"tuned": retain_freed_host_memory(keep), "faults": [], "ms": [], "rss_mb": []}

def run():
    for _ in range(passes):
        faults, start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.perf_counter()
        engine.forward_backward([ForwardBackwardInput("a", [datum])])
        engine.optim_step([("a", AdamParams())])
        report["ms"].append(1000 * (time.perf_counter() - start))
        report["faults"].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults)
        report["rss_mb"].append(psutil.Process().memory_info().rss / 2**20)

thread = threading.Thread(target=run)
thread.start()
thread.join()
print(json.dumps(report))
"""

SETUPS = {"defaults": {"LORAPLEX_KEEP_GLIBC_MALLOC_DEFAULTS": "1"}, "tuned": {}}


def run_passes(passes: int, **env: str) -> dict:
    base = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    base.pop("LORAPLEX_KEEP_GLIBC_MALLOC_DEFAULTS", None)
    out = subprocess.run([sys.executable, "-c", PROGRAM, MODEL, str(TOKENS), str(passes)], cwd=ROOT,
                         capture_output=True, text=True, check=True, env=base | env)
    return json.loads(out.stdout.strip().splitlines()[-1])


def summary(reports: list[dict]) -> dict[str, float]:
    """Medians over the warm passes of every repetition; RSS growth from the first warm pass to the last."""
    warm = lambda key: [v for r in reports for v in r[key][WARMUP:]]
    return {"faults": statistics.median(warm("faults")), "ms": statistics.median(warm("ms")),
            "rss_mb": statistics.median(r["rss_mb"][-1] for r in reports),
            "growth_mb": statistics.median(r["rss_mb"][-1] - r["rss_mb"][WARMUP] for r in reports)}


def main(passes: int = 10, reps: int = 2, write: bool = True) -> None:
    reports: dict[str, list[dict]] = {name: [] for name in SETUPS}
    for _ in range(reps):  # interleaved: the machine's noise falls on both alike
        for name, env in SETUPS.items():
            report = run_passes(passes, **env)
            assert report["tuned"] == (name == "tuned"), f"{name}: the settings were {'not ' * (name == 'tuned')}applied"
            reports[name].append(report)
            print(name, json.dumps({k: [round(v) for v in report[k]] for k in ("faults", "ms", "rss_mb")}), flush=True)
    d, t = summary(reports["defaults"]), summary(reports["tuned"])
    ratio = lambda a, b: f"{a / b:,.{0 if a > 100 * b else 2}f}x" if b else "-"
    rows = [
        ("minor page faults per warm pass, median", f"{d['faults']:,.0f}", f"{t['faults']:,.0f}", ratio(d["faults"], t["faults"])),
        ("warm pass (fwd_bwd + optim_step) ms, median", f"{d['ms']:.0f}", f"{t['ms']:.0f}", ratio(d["ms"], t["ms"])),
        ("RSS after the last pass, MB", f"{d['rss_mb']:.0f}", f"{t['rss_mb']:.0f}", ratio(d["rss_mb"], t["rss_mb"])),
        (f"RSS growth from pass {WARMUP + 1} to {passes}, MB", f"{d['growth_mb']:.0f}", f"{t['growth_mb']:.0f}", ""),
    ]
    text = (f"Command: `.venv/bin/python -m benchmarks.host_memory --passes {passes} --reps {reps}` ({MODEL}, one "
            f"tenant, {TOKENS} tokens per pass, passes on a worker thread, {reps} fresh processes per setting, "
            f"first {WARMUP} passes left out)\n\n| measure | glibc defaults | tuned | defaults / tuned |\n|---|---|---|---|\n"
            + "\n".join(f"| {' | '.join(row)} |" for row in rows) + "\n")
    print(text)
    if write:
        RESULTS.write_text(text)
        print(f"written to {RESULTS}")


if __name__ == "__main__":
    typer.run(main)

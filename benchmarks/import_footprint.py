"""What an API replica and the scheduler load: start time and memory of their imports, before and after a change.

For each entry module (`api.app`: the API; `scheduler.service`: the scheduler; `service.distributed`: the
entry point of both in distributed mode), a fresh Python process imports it and reports the seconds the import
took, its peak RSS, and whether torch came with it. The current tree and the tree of `--before`
(a git revision, checked out into a temporary worktree) are measured alternately, `--reps` times
each, medians reported: the ratios are taken within this one run.

    .venv/bin/python benchmarks/import_footprint.py [--before REV] [--reps 5] [--results PATH]
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import typer

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "import_footprint.md"
ENTRIES = ("api.app", "scheduler.service", "service.distributed")

PROBE = """
import json, resource, sys, time
started = time.perf_counter()
import {module}
seconds = time.perf_counter() - started
print(json.dumps({{"seconds": seconds, "rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "torch": "torch" in sys.modules, "modules": len(sys.modules)}}))
"""


def probe(tree: Path, module: str) -> dict:
    """Import `module` from `tree` in a fresh interpreter: the venv's packages, the tree's own code and SDK."""
    env = {"PYTHONPATH": f"{tree}:{tree / 'client_sdk' / 'src'}", "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", PROBE.format(module=module)], cwd=tree, check=True,
                         capture_output=True, text=True, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(before: str = "HEAD", reps: int = 5, results: Path = RESULTS, write: bool = True) -> None:
    with tempfile.TemporaryDirectory(prefix="loraplex-before-") as tmp:
        old = Path(tmp) / "tree"
        subprocess.run(["git", "worktree", "add", "--detach", str(old), before], cwd=ROOT, check=True,
                       capture_output=True)
        try:
            runs: dict[tuple[str, str], list[dict]] = {}
            for _ in range(reps):  # alternate, so machine noise hits both trees alike
                for module in ENTRIES:
                    for label, tree in (("before", old), ("now", ROOT)):
                        runs.setdefault((module, label), []).append(probe(tree, module))
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(old)], cwd=ROOT, check=True)
    rev = subprocess.run(["git", "rev-parse", "--short", before], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    lines = ["| entry | tree | import s | peak RSS MiB | modules | torch loaded |", "|---|---|---|---|---|---|"]
    ratios = []
    for module in ENTRIES:
        medians = {}
        for label in ("before", "now"):
            r = runs[(module, label)]
            medians[label] = {k: statistics.median(x[k] for x in r) for k in ("seconds", "rss_mib", "modules")}
            lines.append(f"| `{module}` | {label} ({rev if label == 'before' else 'this tree'}) | "
                         f"{medians[label]['seconds']:.2f} | {medians[label]['rss_mib']:.0f} | "
                         f"{medians[label]['modules']:.0f} | {'yes' if r[0]['torch'] else 'no'} |")
        ratios.append(f"`{module}`: now/before import time {medians['now']['seconds'] / medians['before']['seconds']:.2f}, "
                      f"peak RSS {medians['now']['rss_mib'] / medians['before']['rss_mib']:.2f}")
    text = (f"Command: `.venv/bin/python benchmarks/import_footprint.py --before {before} --reps {reps}` "
            f"(median of {reps} alternating runs per tree)\n\n" + "\n".join(lines) + "\n\n" +
            "\n".join(f"- {r}" for r in ratios) + "\n")
    print(text)
    if write:
        results.write_text(text)


if __name__ == "__main__":
    typer.run(main)

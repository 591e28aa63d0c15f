"""Measure a benchmark on the code of another git revision, beside this tree, in one run.

A revision is checked out into a temporary git worktree; the benchmark's measuring part runs as a
child process with that tree first on PYTHONPATH and as its working directory, and the same for
this tree, alternately. The venv is shared. The venv's editable install of this checkout (a finder
that maps `api`, `contract`, `workers`... to this checkout) is taken out of the child, so a module
that the older tree lacks is missing there, not quietly loaded from this one.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Run a script as __main__ with only the chosen tree's project code importable.
LAUNCH = """
import runpy, sys
sys.meta_path[:] = [f for f in sys.meta_path  # setuptools appends its finder as a class
                    if not str(getattr(f, "__module__", "")).startswith("__editable___loraplex_server")]
script, sys.argv = sys.argv[1], sys.argv[1:]
runpy.run_path(script, run_name="__main__")
"""


@contextlib.contextmanager
def worktree(rev: str) -> Iterator[Path]:
    """`rev` checked out (detached) in a temporary directory, removed afterwards."""
    with tempfile.TemporaryDirectory(prefix="loraplex-before-") as tmp:
        tree = Path(tmp) / "tree"
        subprocess.run(["git", "worktree", "add", "--detach", str(tree), rev], cwd=ROOT, check=True,
                       capture_output=True)
        try:
            yield tree
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT, check=True)


def short_rev(rev: str) -> str:
    return subprocess.run(["git", "rev-parse", "--short", rev], cwd=ROOT, capture_output=True, text=True,
                          check=True).stdout.strip()


def run_in_tree(tree: Path, script: Path, *args: str) -> dict:
    """Run `script` (a file of this tree) with `tree`'s code; the JSON object on its last stdout line."""
    env = os.environ | {"PYTHONPATH": f"{tree}:{tree / 'client_sdk' / 'src'}", "HF_HUB_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "-c", LAUNCH, str(script), *args], cwd=tree, env=env, text=True,
                         stdout=subprocess.PIPE, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


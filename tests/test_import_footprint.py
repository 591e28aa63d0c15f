"""API replicas and the scheduler process load no torch: only the torch-free side of the queue contract.

Each entry module is imported in a fresh interpreter (this process has torch loaded already).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "transformers")


@pytest.mark.slow  # a fresh interpreter per module: 3-5 s each on 2 cores
@pytest.mark.parametrize("module", ["api.app", "scheduler.service", "service.distributed"])
def test_importing_loads_no_torch(module):
    probe = f"import json, sys; import {module}; print(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))"
    done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.splitlines()[-1]) == [], f"importing {module} loads {done.stdout.strip()}"

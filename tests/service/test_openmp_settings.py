"""`python -m service serve` sets the OpenMP spin settings before torch loads (service/openmp.py)."""

import json
import os
import subprocess
import sys

SNIPPET = """
import json, os, sys
from service.openmp import spin_between_parallel_regions
applied = spin_between_parallel_regions()
print(json.dumps({"applied": applied, "policy": os.environ.get("OMP_WAIT_POLICY"),
                  "spin": os.environ.get("GOMP_SPINCOUNT")}))
"""


def run(env_overrides: dict, snippet: str = SNIPPET) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    out = subprocess.run([sys.executable, "-c", snippet], env=env | env_overrides, capture_output=True, text=True,
                         check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_set_before_torch_loads_unless_opted_out_or_set_by_the_user():
    assert run({}) == {"applied": True, "policy": "ACTIVE", "spin": "300000"}
    assert run({"LORAPLEX_KEEP_OPENMP_DEFAULTS": "1"})["policy"] is None
    user = run({"OMP_WAIT_POLICY": "PASSIVE"})
    assert not user["applied"] and user["policy"] == "PASSIVE" and user["spin"] is None


def test_too_late_once_torch_is_imported():
    late = run({}, "import torch\n" + SNIPPET)
    assert not late["applied"] and late["policy"] is None

"""`python -m service serve` sets OpenMP's spin settings before torch loads (service/openmp.py).

libgomp prints the settings it runs with under OMP_DISPLAY_ENV=VERBOSE, so the tests read what
torch's OpenMP runtime took, not only the environment."""

import os
import pytest
import re
import subprocess
import sys
from pathlib import Path

import torch

from examples.driver import embedded_server
from service.embedded import free_port

pytestmark = pytest.mark.slow  # fresh interpreters that load torch, and a server
APPLY_THEN_LOAD_TORCH = """
from service.openmp import spin_between_parallel_regions
from service.settings import Settings
print("applied" if spin_between_parallel_regions(Settings().keep_openmp_defaults) else "not applied")
import torch
torch.ones(4).sum()
"""
SETTINGS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "LORAPLEX_KEEP_OPENMP_DEFAULTS")


def reporting_env(**overrides: str) -> dict[str, str]:
    """This environment without the settings and without preloads (vLLM in this test process puts
    libgomp in LD_PRELOAD), as from a shell, with libgomp reporting what it runs with."""
    env = {k: v for k, v in os.environ.items() if k not in SETTINGS + ("LD_PRELOAD",)}
    return env | {"OMP_DISPLAY_ENV": "VERBOSE"} | overrides


def openmp_runtime(code: str, **env_overrides: str) -> tuple[str, dict[str, str]]:
    """(what the snippet printed, the settings libgomp reported)."""
    out = subprocess.run([sys.executable, "-c", code], env=reporting_env(**env_overrides), capture_output=True,
                         text=True, check=True)
    reported = dict(re.findall(r"^\s*(OMP_WAIT_POLICY|GOMP_SPINCOUNT) = '([^']*)'", out.stderr, re.M))
    return out.stdout.strip().splitlines()[-1], reported


def test_libgomp_runs_with_the_spin_settings():
    printed, reported = openmp_runtime(APPLY_THEN_LOAD_TORCH)
    assert printed == "applied"
    assert reported == {"OMP_WAIT_POLICY": "ACTIVE", "GOMP_SPINCOUNT": "100000"}


def test_the_user_settings_and_the_opt_out_win():
    printed, reported = openmp_runtime(APPLY_THEN_LOAD_TORCH, OMP_WAIT_POLICY="PASSIVE")
    assert printed == "not applied" and reported["OMP_WAIT_POLICY"] == "PASSIVE"
    printed, reported = openmp_runtime(APPLY_THEN_LOAD_TORCH, LORAPLEX_KEEP_OPENMP_DEFAULTS="1")
    assert printed == "not applied" and reported["OMP_WAIT_POLICY"] != "ACTIVE"


def test_too_late_once_libgomp_is_loaded():
    printed, reported = openmp_runtime("import torch\n" + APPLY_THEN_LOAD_TORCH)
    assert printed == "not applied" and reported["OMP_WAIT_POLICY"] != "ACTIVE"
    libgomp = next((Path(torch.__file__).parent / "lib").glob("libgomp*.so*"))
    printed, reported = openmp_runtime(APPLY_THEN_LOAD_TORCH, LD_PRELOAD=str(libgomp))
    assert printed == "not applied" and reported["OMP_WAIT_POLICY"] != "ACTIVE"


def test_the_embedded_server_starts_with_them(tmp_path):
    """The README's main command, on `tiny` without the sampler: it serves, under the settings."""
    stderr = tmp_path / "stderr.log"
    with stderr.open("w") as err:
        with embedded_server("tiny", free_port(), env=reporting_env(LORAPLEX_SAMPLER_ENABLED="false"), stderr=err,
                             start_timeout=120):
            pass
    assert "OMP_WAIT_POLICY = 'ACTIVE'" in stderr.read_text()

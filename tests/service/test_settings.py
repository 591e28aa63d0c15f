"""Every setting is declared in service/settings.py, described, and listed in docs/settings.md; the
server's code reads no environment variable of its own outside Settings, and importing a Celery
worker module (as `celery -A` does) reads no settings."""

from __future__ import annotations

import os
import re
import runpy
import subprocess
import sys
from pathlib import Path

from service.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
SERVER_PACKAGES = ("admin", "api", "contract", "db", "migrations", "scheduler", "service", "workers")
# The environment read or written outside Settings, each for a reason of its own:
ENVIRONMENT_USERS = {
    "admin/cli.py",  # huggingface_hub's own progress-bar variable, set before it loads
    "workers/__init__.py",  # MKL's own reproducibility variable, set before its first call
    "service/openmp.py",  # libgomp's own variables, set before torch loads
    "workers/host_memory.py",  # glibc's own MALLOC_* variables: the user tuned malloc already
    "workers/sampler/engine.py",  # vLLM's variables, and the LoRA ops for the plugin below
    "workers/sampler/vllm_platform.py",  # a vLLM plugin: vLLM creates it, no argument reaches it
}


def server_sources() -> list[Path]:
    return sorted(p for package in SERVER_PACKAGES for p in (ROOT / package).rglob("*.py"))


def test_the_settings_page_is_generated_from_the_settings():
    render = runpy.run_path(str(ROOT / "scripts" / "settings_table.py"))["render"]
    assert (ROOT / "docs" / "settings.md").read_text() == render(), \
        "docs/settings.md is out of date: run .venv/bin/python scripts/settings_table.py --write"


def test_every_setting_says_what_it_does():
    assert [name for name, field in Settings.model_fields.items() if not field.description] == []


def test_every_loraplex_variable_the_server_names_is_a_setting():
    settings = {f"LORAPLEX_{name.upper()}" for name in Settings.model_fields}
    named = {(str(path.relative_to(ROOT)), variable) for path in server_sources()
             for variable in re.findall(r"\bLORAPLEX_[A-Z0-9_]*[A-Z0-9]\b", path.read_text())}
    assert sorted((path, v) for path, v in named if v not in settings) == []


def test_only_settings_read_the_environment():
    readers = {str(path.relative_to(ROOT)) for path in server_sources()
               if re.search(r"\bos\.environ\b|\bgetenv\(", path.read_text())}
    assert readers <= ENVIRONMENT_USERS, readers - ENVIRONMENT_USERS


def clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("LORAPLEX_")}


def test_a_celery_worker_module_reads_its_settings_when_the_worker_starts_not_on_import():
    """Imported with a setting that cannot be read, the modules load; the app's configuration
    (read by Celery as the worker starts) comes from the settings."""
    program = """
import sys
import service.celery_worker, service.sampler_worker
assert not service.celery_worker._state and not service.sampler_worker._state
if sys.argv[1] == "configure":
    for module in (service.celery_worker, service.sampler_worker):
        print(module.app.conf.broker_url, module._state["settings"].worker_id)
"""
    unreadable = {"LORAPLEX_PORT": "not-a-port"}
    done = subprocess.run([sys.executable, "-c", program, "import"], cwd=ROOT, capture_output=True, text=True,
                          env=clean_env() | unreadable)
    assert done.returncode == 0, done.stderr[-2000:]
    done = subprocess.run([sys.executable, "-c", program, "configure"], cwd=ROOT, capture_output=True, text=True,
                          env=clean_env() | {"LORAPLEX_REDIS_URL": "redis://example:6379/3", "LORAPLEX_WORKER_ID": "w9"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["redis://example:6379/3", "w9"] * 2

"""docker-compose.yml cannot run here (no Docker engine): check that it parses, that every Loraplex
service's command starts outside Docker, and that its settings are real settings."""

from __future__ import annotations

import subprocess
from pathlib import Path

import yaml

from service.settings import Settings

ROOT = Path(__file__).resolve().parents[2]


def compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def test_compose_file_parses_with_every_service_and_health_check():
    services = compose()["services"]
    assert {"postgres", "redis", "api", "scheduler", "trainer-1", "sampler-1"} <= set(services)
    for name, service in services.items():
        assert "healthcheck" in service, name
    assert "loraplex-data" in compose()["volumes"]


def test_every_loraplex_service_command_starts():
    """Each command with --help appended: the module, the app and the options exist."""
    for name, service in compose()["services"].items():
        command = service.get("command")
        if not command or not command[0].startswith(".venv/"):
            continue
        result = subprocess.run([*command, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, (name, result.stderr[-2000:])


def test_environment_names_real_settings():
    fields = {f"LORAPLEX_{name.upper()}" for name in Settings.model_fields}
    for name, service in compose()["services"].items():
        for variable in service.get("environment", {}):
            if variable.startswith("LORAPLEX_"):
                assert variable in fields, (name, variable)

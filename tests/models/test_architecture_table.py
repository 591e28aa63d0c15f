"""docs/models.md's table of architectures is the one models/architectures.py renders."""

from __future__ import annotations

import runpy
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_architecture_table_is_generated_from_the_architectures():
    script = runpy.run_path(str(ROOT / "scripts" / "architectures_table.py"))
    page = (ROOT / "docs" / "models.md").read_text()
    assert script["updated"](page) == page, \
        "docs/models.md's table is out of date: run .venv/bin/python scripts/architectures_table.py --write"

"""The rooms import only along the data flow (docs/architecture.md, "Layout").

api -> contract <- scheduler -> workers, with messaging, db, models and storage below them and the
SDK's wire types (`loraplex`) at the bottom. `service/`, `admin/`, `benchmarks/` and `migrations/`
compose the rest and may import any room. Every import counts, including one inside a function:
a lazy import still ties the rooms together.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# room -> the rooms it may import (besides itself and third-party packages)
ALLOWED: dict[str, set[str]] = {
    "loraplex": set(),
    "contract": {"loraplex"},
    "storage": {"contract"},
    "db": {"contract", "storage", "loraplex"},
    "models": {"contract", "storage", "loraplex"},
    "messaging": {"contract", "db", "storage", "loraplex"},
    "workers": {"contract", "storage", "models", "loraplex"},
    "scheduler": {"contract", "storage", "db", "models", "messaging", "loraplex"},
    "api": {"contract", "storage", "db", "models", "messaging", "loraplex"},
}
SOURCE_DIRS = {"loraplex": ROOT / "client_sdk" / "src" / "loraplex"}
ROOMS = set(ALLOWED) | {"service", "admin", "benchmarks", "migrations"}


def imported_rooms(path: Path) -> set[tuple[str, int]]:
    """(room, line) for each absolute import of a project room in one file."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        found |= {(name.split(".")[0], node.lineno) for name in names if name.split(".")[0] in ROOMS}
    return found


def test_every_room_is_a_package_that_exists():
    for room in ALLOWED:
        assert (SOURCE_DIRS.get(room, ROOT / room) / "__init__.py").is_file(), room


@pytest.mark.parametrize("room", sorted(ALLOWED))
def test_room_imports_only_below_itself(room):
    allowed = ALLOWED[room] | {room}
    against = [
        f"{path.relative_to(ROOT)}:{line} imports {other}"
        for path in sorted(SOURCE_DIRS.get(room, ROOT / room).rglob("*.py"))
        for other, line in sorted(imported_rooms(path))
        if other not in allowed
    ]
    assert not against, f"{room} may import only {sorted(ALLOWED[room])}:\n" + "\n".join(against)


def test_the_checker_sees_a_lazy_import(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("def f():\n    from workers.trainer import engine\n    import api.app\n")
    assert imported_rooms(probe) == {("workers", 2), ("api", 3)}

"""The repository reads on its own: no tracked file outside tests/ points at documents beside the
checkout (which a user who clones the project does not have), and every relative link in the
README and docs/ names a file that exists. The protocol and the design are docs/protocol.md and
docs/architecture.md."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Pieces of the names, joined here, so that this file does not mention them itself.
OUTSIDE = ("../" + "shared", "tinker-" + "protocol.md", "DESIGN" + ".md")

_FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,}).*?^ {0,3}\1", re.MULTILINE | re.DOTALL)
_CODE_SPAN = re.compile(r"`[^`\n]*`")
_LINK = re.compile(r"\[[^\]\n]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")


def _tracked() -> list[str]:
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    return [name for name in out.decode().split("\0") if name]


def test_no_tracked_file_points_outside_the_repository():
    found = []
    for name in _tracked():
        path = ROOT / name
        if name.startswith("tests/") or not path.is_file():  # tests/ may name them; a staged deletion is gone
            continue
        text = path.read_bytes().decode("utf-8", errors="replace")
        for lineno, line in enumerate(text.splitlines(), 1):
            found += [f"{name}:{lineno}: {needle}" for needle in OUTSIDE if needle in line]
    assert not found, "files citing documents outside the repository (cite docs/protocol.md or " \
                      "docs/architecture.md instead):\n" + "\n".join(found)


def _relative_links(markdown: str) -> list[str]:
    """The link targets of `markdown` that are paths (no URL scheme), outside code blocks and spans."""
    prose = _CODE_SPAN.sub("", _FENCE.sub("", markdown))
    return [target for target in _LINK.findall(prose) if not _SCHEME.match(target)]


def test_every_relative_markdown_link_resolves():
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    broken = []
    for page in pages:
        for target in _relative_links(page.read_text()):
            path = target.split("#", 1)[0]
            if path and not (page.parent / path).exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert not broken, "links to files that do not exist:\n" + "\n".join(broken)


def test_the_link_finder_skips_code_and_urls():
    page = "[a](docs/x.md) `[b](y.md)` [c](https://e.org) [d](#top)\n```\n[e](z.md)\n```\n[f](../g.md \"title\")"
    assert _relative_links(page) == ["docs/x.md", "#top", "../g.md"]

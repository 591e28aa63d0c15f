"""The files a client needs to load a served model's tokenizer by hub id, with sizes, SHA-256 and
a revision derived from them.

api/routes/tokenizers.py serves them; registry.publish_tokenizer and `loraplex tokenizer pull`
put them in a Hugging Face cache snapshot named by that revision. Only named tokenizer files
(and config.json) go out, never the weights or anything else that sits in the model's folder.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

# What AutoTokenizer may read. config.json too: transformers 5 reads it on the hub/cache path to
# pick the tokenizer class when tokenizer_config.json does not settle it (docs/protocol.md, "Tokenizers").
TOKENIZER_FILES = (
    "config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "chat_template.jinja", "chat_template.json", "tokenizer.model", "vocab.json", "merges.txt", "vocab.txt",
)


@dataclass(frozen=True)
class TokenizerFile:
    path: str  # relative to the model folder (and to the snapshot)
    size: int
    sha256: str


@dataclass(frozen=True)
class TokenizerManifest:
    revision: str  # 40 hex digits: what huggingface_hub takes for a commit hash
    files: tuple[TokenizerFile, ...]

    def file(self, path: str) -> TokenizerFile | None:
        return next((f for f in self.files if f.path == path), None)

    def to_json(self) -> list[dict]:
        return [{"path": f.path, "size": f.size, "sha256": f.sha256} for f in self.files]


def tokenizer_manifest(folder: Path) -> TokenizerManifest:
    # keyed by the files' sizes and mtimes too: a folder rebuilt in place is hashed again
    stats = tuple((name, st.st_size, st.st_mtime_ns) for name in TOKENIZER_FILES
                  if (st := _stat(folder / name)) is not None)
    return _manifest(str(folder), stats)


def _stat(path: Path):
    return path.stat() if path.is_file() else None


@lru_cache(maxsize=16)
def _manifest(folder: str, stats: tuple) -> TokenizerManifest:
    files = tuple(TokenizerFile(name, size, hashlib.sha256(Path(folder, name).read_bytes()).hexdigest())
                  for name, size, _ in stats)
    if not any(f.path in ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt") for f in files):
        raise FileNotFoundError(f"{folder}: no tokenizer files (none of {', '.join(TOKENIZER_FILES[1:])})")
    # Same files, same revision (a second pull changes nothing); changed files, a new snapshot.
    listing = "".join(f"{f.path}\0{f.sha256}\n" for f in files).encode()
    return TokenizerManifest(hashlib.sha1(listing).hexdigest(), files)

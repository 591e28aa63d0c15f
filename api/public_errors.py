"""What a stored error may show its reader: tinker:// paths, never server paths or tenant ids.

Engines and stores report the locations they failed on (`<store>/checkpoints/<tenant id>/<run>/
sampler_weights/<name>/seq-3/adapter_model.safetensors`); users know that checkpoint as
`tinker://<run>/sampler_weights/<name>`. Errors are rewritten when they are answered (futures.py),
so no engine, store or future route has to remember it.
"""

from __future__ import annotations

import re

MAX_ERROR_CHARS = 500  # an error names the field and the problem; it never echoes the input
_PART = r"[^/\s'\"]+"


def public_error(message: str, checkpoint_dir: str, store_root: str) -> str:
    """`message` with checkpoint locations as tinker:// paths (plus the file within, if named) and
    any other location under the server's store shown relative to it."""
    checkpoint = re.compile(
        re.escape(checkpoint_dir.rstrip("/")) + rf"/{_PART}/({_PART})/(weights|sampler_weights)/({_PART})"
        rf"(?:/seq-\d+)?(/{_PART})*")
    message = checkpoint.sub(lambda m: f"tinker://{m[1]}/{m[2]}/{m[3]}" + (f" (file {m[4][1:]})" if m[4] else ""),
                             message)
    return message.replace(store_root.rstrip("/") + "/", "<store>/")

"""A refused training request releases its seq_id at once, whichever check refused it.

The SDK numbers a model's training requests 1, 2, 3, ... and the scheduler runs seq_id n+1 only
after n (scheduler/ordering.py). A request refused at the door (validation, a hard quota, an
unknown route, a body too large or not a protobuf) still used its number on the client: unless
the server records it, the model's next request waits for it until the scheduler's gap rule
gives up on it. So the request guard (api/request_guard.py) hands every 4xx answer, except 429
(the SDK retries those with the same seq_id), whose body names a (model_id, seq_id) to
`record_refusal`: one place for all routes, including routes that do not exist.

Only the model's owner releases its seq_ids: the key must be live and own the model, and the
seq_id must lie in the model's window (api/submit.py). A refusal without a live key (401) is not
recorded: anyone could send it. Such a seq_id, like one lost on the network, is left to the
scheduler's gap rule (scheduler/service.py).
"""

from __future__ import annotations

import io
import json
import re
from typing import Any

import zstandard
from sqlalchemy.orm import Session

from api.deps import tenant_of_key
from api.input_policy import ID_CHARS, is_text
from api.submit import seq_window, submit
from contract.kinds import RequestKind
from contract.payloads import RejectedPayload
from db.models import TrainingModel

# What is read of a body too large to accept, to find its (model_id, seq_id): the SDK writes
# both first (protobuf fields 1 and 2; the first keys of its JSON bodies).
PREFIX_BYTES = 64 * 1024
# zstd gives out nothing of a compressed block until it has all of it, and a block holds up to
# 128 KiB: a zstd body's first PREFIX_BYTES may end inside its first block, with the ids in it.
# This much holds the frame header (at most 18 bytes), the first block's header (3) and the block.
ZSTD_PREFIX_BYTES = 128 * 1024 + 64
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"  # every zstd frame starts with it
_JSON_MODEL_ID = re.compile(rb'"model_id"\s*:\s*"([^"\\]{1,256})"')
_JSON_SEQ_ID = re.compile(rb'"seq_id"\s*:\s*(\d{1,10})\b')


def prefix_bytes(content_encoding: str) -> int:
    """How much of a refused body to keep for `read_seq_ref`."""
    return ZSTD_PREFIX_BYTES if "zstd" in content_encoding.lower() else PREFIX_BYTES


def read_seq_ref(body: bytes, content_type: str, content_encoding: str) -> tuple[str, int] | None:
    """The (model_id, seq_id) a body names, from all of it or only its beginning; None if unreadable.
    A body labelled zstd that is no zstd frame is read as it is: its ids may be plain."""
    if "zstd" in content_encoding.lower() and body.startswith(ZSTD_MAGIC):
        body = _zstd_prefix(body)
    if "protobuf" in content_type.lower():
        return _from_protobuf(body)
    return _from_json(body)


def _zstd_prefix(body: bytes) -> bytes:
    """What a (possibly truncated) zstd frame starts with, at most PREFIX_BYTES of it."""
    reader = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(body))
    out = b""
    try:
        while len(out) < PREFIX_BYTES and (chunk := reader.read(PREFIX_BYTES - len(out))):
            out += chunk
    except zstandard.ZstdError:
        pass  # truncated or corrupt past this point: keep what came out before
    return out


def _from_json(body: bytes) -> tuple[str, int] | None:
    try:
        obj: Any = json.loads(body)
    except (ValueError, RecursionError):  # not JSON, or only its beginning: look for the two keys
        model, seq = _JSON_MODEL_ID.search(body), _JSON_SEQ_ID.search(body)
        return (model.group(1).decode(errors="replace"), int(seq.group(1))) if model and seq else None
    if isinstance(obj, dict) and isinstance(obj.get("model_id"), str) and type(obj.get("seq_id")) is int:
        model_id = obj["model_id"]
        # an id no model can have is not looked up: a lone surrogate cannot even be sent to the database
        if len(model_id) <= ID_CHARS and is_text(model_id):
            return model_id, obj["seq_id"]
    return None


def _from_protobuf(body: bytes) -> tuple[str, int] | None:
    """Fields 1 (model_id, string) and 2 (seq_id, int32) of a ForwardBackwardRequest, read from its
    first bytes. The protobuf library cannot parse a truncated message, so the two tags are read here."""
    model_id, seq_id, pos = None, None, 0
    while pos < len(body) and (model_id is None or seq_id is None):
        tag, pos = _varint(body, pos)
        if tag is None:
            return None
        field, wire_type = tag >> 3, tag & 7
        if field == 1 and wire_type == 2:
            length, pos = _varint(body, pos)
            if length is None or length > 256 or pos + length > len(body):
                return None
            try:
                model_id = body[pos:pos + length].decode()
            except UnicodeDecodeError:
                return None
            pos += length
        elif field == 2 and wire_type == 0:
            seq_id, pos = _varint(body, pos)
        else:
            return None  # the SDK writes fields in order: anything else first means it is not one of its messages
    return (model_id, seq_id) if model_id is not None and seq_id is not None else None


def _varint(data: bytes, pos: int) -> tuple[int | None, int]:
    value = 0
    for shift in range(0, 64, 7):
        if pos >= len(data):
            return None, pos
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
    return None, pos


def record_refusal(app_state: Any, api_key: str | None, model_id: str, seq_id: int, error: str) -> bool:
    """Record the refused request as failed, so its seq_id passes; True if it was recorded."""
    db: Session
    with app_state.sessions() as db:
        tenant = tenant_of_key(db, api_key, app_state.tokens)
        owner = db.get(TrainingModel, model_id) if tenant is not None else None
        base = app_state.models.find(owner.base_model) if owner is not None else None
        if owner is None or owner.tenant_id != tenant.id or owner.deleted_at is not None or base is None:
            return False
        window = seq_window(db, model_id)
        if window is None or not window[0] <= seq_id <= window[1]:
            return False  # already run (a retry: the original answers it) or absurd (refused, not recorded)
        submit(base.scheduler, db, tenant_id=tenant.id, model_id=model_id, seq_id=seq_id,
               kind=RequestKind.REJECTED, payload=RejectedPayload().to_bytes(),
               error={"error": error, "category": "user"})
        return True

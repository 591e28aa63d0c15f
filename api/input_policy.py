"""One input policy for every route: what the server takes in, so nothing it stores breaks a later read.

Applied at the edge, before a route parses anything (api/request_guard.py), to every body a route
reads as JSON, whatever its Content-Type (the inference routes parse any body as JSON):

- **UTF-8 only.** A body that is not valid UTF-8 is a 400, and so is a string (or key) holding a lone
  surrogate: JSON lets `"\\ud800"` through, but no database, encoder or answer can carry it (it was a
  500 on get_info, retrieve_future, chat messages, and broke GET sessions/{id} once stored).
- **Bounded depth.** Objects and arrays nest at most `MAX_JSON_DEPTH` levels. Python's JSON decoder
  and encoder, pydantic's serialiser (255 levels) and SQLAlchemy's JSON columns all stop somewhere
  under 1,000 levels: a user_metadata nested 900 levels was stored, then every GET training_runs of
  its tenant answered 500.

A body that is not JSON at all is left to its route, which says so in its own words. Protobuf bodies
(forward_backward) are decoded by the codec, which holds proto3 strings to UTF-8; their strings are
bounded by `check_wire_text`. Form bodies (the dashboard's login) are percent-decoded by Starlette,
which replaces what is not UTF-8.

At each wire type's one definition (the request models of api/routes/ and api/inference/), the
annotated types below bound each field: every stored string has a size (`Label`, `Id`), every
metadata object a depth and a size (`Metadata`), every integer its column's range (`Int32`, `SeqId`,
`Seed`, ...). Refusals are 400 (the edge) or 422 (a field's bound), `<field>: <what is wrong>`, never
the input echoed, never a Python internal.

Reads are robust too: whatever was stored before these bounds existed is answered through `readable`,
which cuts what is nested too deep and replaces lone surrogates, so an old row cannot make a listing
fail. Documented in docs/protocol.md ("Input policy").
"""

from __future__ import annotations

import json
from typing import Annotated, Any

from pydantic import AfterValidator, Field
from pydantic_core import PydanticCustomError

# --- limits ---------------------------------------------------------------------------------------

# Levels of objects and arrays in a body. The deepest wire type is a tool's JSON schema inside a chat
# request (tools[0].function.parameters.properties.x.items..., a dozen levels for real tools); 64 is
# generous for that and far below every library limit above (the shallowest, pydantic's, is 255).
MAX_JSON_DEPTH = 64
# user_metadata of sessions, models and checkpoints: what a client tags its work with (a recipe name,
# a git revision, a wandb link). Stored as JSON beside the row and answered with every listing.
METADATA_MAX_DEPTH = 8  # the object itself is level 1
METADATA_MAX_BYTES = 64 * 1024  # its compact JSON encoding
METADATA_MAX_KEYS = 256  # entries of any one object or array in it
# A label: sdk_version, display_name, project_id, a tag, a metadata key, a stop string.
LABEL_CHARS = 256
MAX_TAGS = 64
# An id or tinker:// path a body names: session, model, sampler and request ids are at most 53
# characters, a tinker:// path at most ~200 (checkpoint names are 1-128 characters).
ID_CHARS = 256
MAX_STOP_SEQUENCES = 64

INT32_MAX = 2**31 - 1  # an INTEGER column; seq_id is int32 on the wire (tinker_public.proto)
INT64_MAX = 2**63 - 1  # a BIGINT column; what torch and vLLM take as a seed

# How much more UTF-8 text than the tokens could ever cover a prompt may carry before it is refused
# untokenised (`prompt_byte_limit`). Every token stands for at most `max_token_bytes` bytes of text
# (its longest vocabulary entry, as the vocabulary spells it: a byte-level BPE writes each byte as one
# or two bytes of UTF-8, SentencePiece writes a space as the 3-byte '▁', so the spelling never
# undercounts). The one way text loses bytes before it is tokenised is normalisation: NFC/NFKC compose
# up to three code points into one (Hangul jamo: 9 bytes become 3). A factor of 4 covers that, so a
# prompt over the limit could never fit the context, whatever it says.
PROMPT_BYTES_PER_TOKEN_SLACK = 4


# --- field types (pydantic) -----------------------------------------------------------------------

Int32 = Annotated[int, Field(ge=-INT32_MAX - 1, le=INT32_MAX)]
Int64 = Annotated[int, Field(ge=-INT64_MAX - 1, le=INT64_MAX)]
NonNegInt32 = Annotated[int, Field(ge=0, le=INT32_MAX)]
SeqId = Annotated[int, Field(ge=1, le=INT32_MAX)]  # a training request's place in its model's order
SessionSeq = Annotated[int, Field(ge=0, le=INT32_MAX)]  # model_seq_id, sampling_session_seq_id
Seed = Annotated[int, Field(ge=0, le=INT64_MAX)]

Label = Annotated[str, Field(max_length=LABEL_CHARS)]
Id = Annotated[str, Field(max_length=ID_CHARS)]  # an id or a tinker:// path
Tags = Annotated[list[Label], Field(max_length=MAX_TAGS)]
StopStrings = Annotated[list[Label], Field(max_length=MAX_STOP_SEQUENCES)]
StopTokens = Annotated[list[int], Field(max_length=MAX_STOP_SEQUENCES)]
# OpenAI's `metadata` (chat, completions, responses), with OpenAI's own documented limits: 16 pairs,
# keys of at most 64 characters, values of at most 512.
OpenAIMetadata = Annotated[dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]],
                           Field(max_length=16)]


def metadata_problem(value: Any) -> str | None:
    """Why `value` cannot be stored as user_metadata (None: it can)."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            if depth > METADATA_MAX_DEPTH:
                return f"nested deeper than {METADATA_MAX_DEPTH} levels"
            if len(item) > METADATA_MAX_KEYS:
                return f"an object or array of more than {METADATA_MAX_KEYS} entries"
            if isinstance(item, dict):
                for key in item:
                    if len(key) > LABEL_CHARS:
                        return f"a key longer than {LABEL_CHARS} characters"
                stack.extend((v, depth + 1) for v in item.values())
            else:
                stack.extend((v, depth + 1) for v in item)
        elif isinstance(item, str) and not is_text(item):
            return "not valid Unicode text (a lone surrogate)"
    try:
        size = len(json.dumps(value, separators=(",", ":"), allow_nan=False))
    except ValueError:
        return "holds NaN or Infinity, which JSON cannot"
    if size > METADATA_MAX_BYTES:
        return f"{size} bytes as JSON, over the limit of {METADATA_MAX_BYTES}"
    return None


def _check_metadata(value: Any) -> Any:
    problem = None if value is None else metadata_problem(value)
    if problem is not None:
        raise PydanticCustomError("metadata", problem)
    return value


Metadata = Annotated[dict[str, Any], AfterValidator(_check_metadata)]
StrMetadata = Annotated[dict[str, Label], Field(max_length=64), AfterValidator(_check_metadata)]


# --- the edge: a JSON body before its route -------------------------------------------------------


def is_text(value: str) -> bool:
    """Whether `value` is valid Unicode text (encodable as UTF-8: no lone surrogates)."""
    if value.isascii():
        return True
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def json_body_problem(body: bytes) -> str | None:
    """What the policy refuses in a JSON body (`<field>: <what is wrong>`), or None. A body that is not
    JSON is left to its route (None)."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        return f"body: not valid UTF-8 (at byte {e.start})"
    try:
        value = json.loads(text)
    except RecursionError:  # Python's decoder gives up near 1,000 levels
        return f"body: nested deeper than {MAX_JSON_DEPTH} levels of objects and arrays"
    except ValueError:
        return None
    return value_problem(value)


def value_problem(value: Any) -> str | None:
    """The first lone surrogate or too-deep nesting in a decoded JSON value, named by its path."""
    stack: list[tuple[Any, int, tuple]] = [(value, 0, ())]
    while stack:
        item, depth, path = stack.pop()
        if type(item) is str:
            if not is_text(item):
                return f"{field_name(path)}: not valid Unicode text (a lone surrogate)"
            continue
        if depth >= MAX_JSON_DEPTH:
            return f"{field_name(path)}: nested deeper than {MAX_JSON_DEPTH} levels of objects and arrays"
        if type(item) is dict:
            for key, child in item.items():
                if not is_text(key):
                    return f"{field_name(path)}: a key that is not valid Unicode text (a lone surrogate)"
                if type(child) in (dict, list, str):
                    stack.append((child, depth + 1, (*path, key)))
        else:  # a list
            for i, child in enumerate(item):
                kind = type(child)
                if kind is dict or kind is list or kind is str:
                    stack.append((child, depth + 1, (*path, i)))
    return None


def field_name(path: tuple) -> str:
    """A JSON path as errors name fields: `messages[0].content`; long paths shortened."""
    name = ""
    for part in path[:12]:
        name += f"[{part}]" if isinstance(part, int) else (f".{part[:64]}" if name else part[:64])
    if len(path) > 12:
        name += "..."
    return name or "body"


def check_wire_text(fields: dict[str, str]) -> str | None:
    """A protobuf request's strings (already UTF-8, the codec holds proto3 to that) against their bounds."""
    for name, value in fields.items():
        if len(value) > ID_CHARS:
            return f"{name}: at most {ID_CHARS} characters, got {len(value)}"
    return None


# --- prompts: refuse before tokenising ------------------------------------------------------------


def prompt_byte_limit(max_context: int, max_token_bytes: int) -> int:
    """The most UTF-8 bytes of text a prompt of `max_context` tokens can hold (see
    PROMPT_BYTES_PER_TOKEN_SLACK): text over it is refused before the tokeniser sees it."""
    return PROMPT_BYTES_PER_TOKEN_SLACK * max_context * max(max_token_bytes, 1)


def text_bytes(value: Any) -> int:
    """The UTF-8 bytes of every string (keys included) in a decoded JSON value."""
    total, stack = 0, [value]
    while stack:
        item = stack.pop()
        kind = type(item)
        if kind is str:
            total += len(item) if item.isascii() else len(item.encode("utf-8", "surrogatepass"))
        elif kind is dict:
            for key, child in item.items():
                total += len(key.encode("utf-8", "surrogatepass"))
                stack.append(child)
        elif kind is list:
            stack.extend(child for child in item if type(child) in (str, dict, list))
    return total


def largest_text_field(body: dict) -> tuple[str, int]:
    """(the top-level field with the most text, the bytes of text in the whole body)."""
    sizes = {str(key): text_bytes(value) for key, value in body.items()}
    return max(sizes, key=sizes.__getitem__, default="body"), sum(sizes.values())


# --- reads: what was stored before the policy -----------------------------------------------------

_CUT = f"(not shown: nested deeper than {MAX_JSON_DEPTH} levels)"


def readable(value: Any, depth: int = 0) -> Any:
    """A stored JSON value as it can be answered: containers deeper than MAX_JSON_DEPTH replaced by a
    note, lone surrogates by U+FFFD. What the policy admits comes back unchanged (recursion is bounded
    by the cut)."""
    kind = type(value)
    if kind is str:
        return value if is_text(value) else _replace_surrogates(value)
    if kind is dict or kind is list:
        if depth >= MAX_JSON_DEPTH:
            return _CUT
        if kind is dict:
            return {(k if is_text(k) else _replace_surrogates(k)) if isinstance(k, str) else k: readable(v, depth + 1)
                    for k, v in value.items()}
        return [readable(v, depth + 1) for v in value]
    return value


def _replace_surrogates(value: str) -> str:
    return value.encode("utf-16", "surrogatepass").decode("utf-16", "replace")

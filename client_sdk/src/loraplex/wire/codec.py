"""Tinker wire codec: protobuf / JSON bytes <-> numpy, with no torch.

Decoding functions take untrusted client bytes and raise :class:`WireError` (a ``ValueError``
naming the offending field) for anything malformed; no protobuf, zstd or numpy exception escapes.
Encoding functions take server-produced values and raise plain ``ValueError`` for inputs the
official SDK could not read (they indicate a server bug, not a client error).

All numeric byte blobs on the wire are little-endian raw arrays (docs/protocol.md, "Byte blobs").
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import zstandard

from . import tinker_public_pb2 as pb

__all__ = [
    "DEFAULT_MAX_DECOMPRESSED_BYTES",
    "DEFAULT_MAX_DENSE_ELEMENTS",
    "METRIC_REDUCTIONS",
    "PROTOBUF",
    "TOPK_MASK_LOGPROB",
    "DatumWire",
    "ForwardBackwardWire",
    "ProvenanceSpanWire",
    "SampledSequenceWire",
    "WireError",
    "decode_body",
    "decode_forward_backward_request",
    "decode_tensor",
    "encode_forward_backward_output",
    "encode_sample_response",
    "model_input_tokens",
    "tensor_data_from_json",
]

# The Content-Type of protobuf request bodies and results (the SDK's, the API's and stored results').
PROTOBUF = "application/x-protobuf"
DEFAULT_MAX_DECOMPRESSED_BYTES = 256 * 1024 * 1024
# Cap on the dense size of a CSR tensor (its shape is not bounded by the body size).
DEFAULT_MAX_DENSE_ELEMENTS = 1 << 26
# Reductions the SDK's chunk combiner knows (lib/chunked_fwdbwd_helpers.py REDUCE_MAP).
METRIC_REDUCTIONS = frozenset({"mean", "sum", "min", "max", "slack", "hash2", "unique"})
# Sentinel the SDK uses for empty top-k cells (types/topk_logprobs.py MASK_LOGPROB).
TOPK_MASK_LOGPROB = -99999.0

_MAX_TOKEN_ID = 2**31 - 1  # tokens travel as int32 in the proto


class WireError(ValueError):
    """Malformed request data. ``field`` names where, e.g. ``data[3].loss_fn_inputs['weights']``."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


@dataclass(frozen=True)
class ProvenanceSpanWire:
    kind: Literal["prompt", "sampled"]
    sequence_id: str
    offset: int
    length: int


@dataclass(frozen=True, eq=False)
class DatumWire:
    tokens: np.ndarray  # int64 [N], the model input chunks concatenated
    loss_fn_inputs: dict[str, np.ndarray]  # float32 / int64, dense (CSR already densified)
    model_input_spans: tuple[ProvenanceSpanWire, ...] = ()
    loss_fn_input_spans: tuple[ProvenanceSpanWire, ...] = ()


@dataclass(frozen=True, eq=False)
class ForwardBackwardWire:
    model_id: str
    seq_id: int
    forward_only: bool
    loss_fn: str
    loss_fn_config: dict[str, float | str]
    data: list[DatumWire] = field(default_factory=list)


@dataclass(frozen=True)
class SampledSequenceWire:
    tokens: Sequence[int] | np.ndarray
    logprobs: Sequence[float] | np.ndarray
    stop_reason: Literal["stop", "length"]
    # Per generated position: up to k (token_id, logprob) pairs, or None.
    topk_logprobs: Sequence[Sequence[tuple[int, float]] | None] | None = None


# proto DType -> (little-endian wire dtype, widened numpy dtype)
_PROTO_DTYPES: dict[int, tuple[str, np.dtype, str]] = {
    pb.DTYPE_FLOAT32: ("FLOAT32", np.dtype("<f4"), "float32"),
    pb.DTYPE_INT64: ("INT64", np.dtype("<i8"), "int64"),
    pb.DTYPE_INT32: ("INT32", np.dtype("<i4"), "int64"),
    pb.DTYPE_BFLOAT16: ("BFLOAT16", np.dtype("<u2"), "float32"),
}
_JSON_DTYPES = {"float32": np.dtype(np.float32), "int64": np.dtype(np.int64)}


# ---------------------------------------------------------------------------------------------
# Request decoding


def decode_body(
    body: bytes,
    content_encoding: str | None,
    *,
    max_decompressed_bytes: int = DEFAULT_MAX_DECOMPRESSED_BYTES,
) -> bytes:
    """Undo ``Content-Encoding`` (``identity`` or ``zstd``), refusing output over the cap."""
    codings = [c.strip().lower() for c in (content_encoding or "").split(",") if c.strip()]
    for coding in reversed(codings):
        if coding == "identity":
            continue
        if coding != "zstd":
            raise WireError("Content-Encoding", f"unsupported content coding {coding!r}")
        body = _zstd_decompress(body, max_decompressed_bytes)
    return body


_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"  # the first four bytes of every zstd frame


def _zstd_decompress(body: bytes, cap: int) -> bytes:
    """One zstd frame (what the SDK's ``ZstdCompressor().compress`` writes), at most ``cap`` bytes out.

    ``decompress`` rejects truncated frames and trailing data (a streaming reader would silently
    return a short result); with ``max_output_size`` it never produces more than ``cap`` bytes.
    """
    if not body.startswith(_ZSTD_MAGIC):
        raise WireError("body", "Content-Encoding says zstd, but the body is not a zstd frame "
                                "(it does not start with the zstd magic number 28 b5 2f fd)")
    try:
        declared = zstandard.frame_content_size(body)
    except zstandard.ZstdError as e:
        raise WireError("body", f"invalid zstd frame: {e}") from None
    if declared > cap:
        raise WireError("body", f"zstd frame declares {declared} bytes, over the {cap}-byte cap")
    try:
        return zstandard.ZstdDecompressor().decompress(body, max_output_size=cap, allow_extra_data=False)
    except zstandard.ZstdError as e:
        extra = "" if declared >= 0 else f" (or it decompresses to over the {cap}-byte cap)"
        if "did not decompress full frame" in str(e):
            extra += ": the frame is cut short (truncated body?)"
        raise WireError("body", f"invalid zstd data: {e}{extra}") from None


def decode_forward_backward_request(
    body: bytes,
    content_encoding: str | None,
    *,
    max_decompressed_bytes: int = DEFAULT_MAX_DECOMPRESSED_BYTES,
    max_dense_elements: int = DEFAULT_MAX_DENSE_ELEMENTS,
    csr_pad: float = 0,
) -> ForwardBackwardWire:
    """Decode a ``tinker_public.ForwardBackwardRequest`` body (POST /api/v1/forward_backward)."""
    raw = decode_body(body, content_encoding, max_decompressed_bytes=max_decompressed_bytes)
    msg = pb.ForwardBackwardRequest()
    try:
        msg.ParseFromString(raw)
    except Exception as e:  # DecodeError, or RuntimeError/UnicodeError from some runtimes
        raise WireError(
            "body", f"not a valid tinker_public.ForwardBackwardRequest protobuf: {e}"
        ) from None

    config: dict[str, float | str] = {k: float(v) for k, v in msg.loss_fn_config.items()}
    for key, value in msg.loss_fn_config_v2.items():
        kind = value.WhichOneof("value")
        if kind is None:
            raise WireError(f"loss_fn_config_v2[{key!r}]", "neither number nor text is set")
        config[key] = value.number if kind == "number" else value.text

    data = [_decode_datum(d, f"data[{i}]", csr_pad, max_dense_elements) for i, d in enumerate(msg.data)]
    return ForwardBackwardWire(
        model_id=msg.model_id,
        seq_id=msg.seq_id,
        forward_only=msg.forward_only,
        loss_fn=msg.loss_fn,
        loss_fn_config=config,
        data=data,
    )


def _decode_datum(d: Any, where: str, pad: float, max_elems: int) -> DatumWire:
    parts = []
    for j, chunk in enumerate(d.model_input):
        cf = f"{where}.model_input.chunks[{j}]"
        kind = chunk.WhichOneof("chunk")
        if kind != "encoded_text":
            what = f"{kind} chunks are" if kind else "an empty chunk is"
            raise WireError(cf, f"{what} not supported by this server")
        raw = chunk.encoded_text.tokens
        if len(raw) % 4:
            raise WireError(f"{cf}.encoded_text.tokens", f"byte length {len(raw)} is not a multiple of 4 (int32)")
        toks = np.frombuffer(raw, dtype="<i4")
        if toks.size and int(toks.min()) < 0:
            raise WireError(f"{cf}.encoded_text.tokens", f"negative token id {int(toks.min())}")
        parts.append(toks)
    tokens = np.concatenate(parts).astype(np.int64) if parts else np.empty(0, np.int64)
    if tokens.size == 0:
        raise WireError(f"{where}.model_input", "no tokens")
    inputs = {
        name: decode_tensor(t, f"{where}.loss_fn_inputs[{name!r}]", pad=pad, max_dense_elements=max_elems)
        for name, t in d.loss_fn_inputs.items()
    }
    return DatumWire(
        tokens=tokens,
        loss_fn_inputs=inputs,
        model_input_spans=_decode_spans(d.model_input_spans, f"{where}.model_input_spans"),
        loss_fn_input_spans=_decode_spans(d.loss_fn_input_spans, f"{where}.loss_fn_input_spans"),
    )


def _decode_spans(spans: Any, where: str) -> tuple[ProvenanceSpanWire, ...]:
    out = []
    for k, span in enumerate(spans):
        kind = span.WhichOneof("span")
        if kind is None:
            raise WireError(f"{where}[{k}]", "neither prompt_tokens nor sampled_tokens is set")
        s = getattr(span, kind)
        if s.offset < 0 or s.length < 0:
            raise WireError(f"{where}[{k}]", f"negative offset/length ({s.offset}, {s.length})")
        span_kind = "prompt" if kind == "prompt_tokens" else "sampled"
        out.append(ProvenanceSpanWire(span_kind, s.sequence_id, s.offset, s.length))
    return tuple(out)


def decode_tensor(
    t: Any, where: str, *, pad: float = 0, max_dense_elements: int = DEFAULT_MAX_DENSE_ELEMENTS
) -> np.ndarray:
    """Decode a ``tinker_public.Tensor`` into a dense float32 / int64 array (CSR cells not listed = ``pad``)."""
    if t.dtype not in _PROTO_DTYPES:
        raise WireError(where, f"unknown dtype {t.dtype} ({_dtype_name(t.dtype)})")
    name, wire_dt, _ = _PROTO_DTYPES[t.dtype]
    shape = [int(s) for s in t.shape]
    if any(s < 0 for s in shape):
        raise WireError(where, f"negative dimension in shape {shape}")
    if t.WhichOneof("encoding") == "sparse_csr":
        csr = t.sparse_csr
        values = _blob(csr.values, wire_dt, f"{where}.sparse_csr.values", name)
        crow = _blob(csr.crow_indices, np.dtype("<i8"), f"{where}.sparse_csr.crow_indices", "INT64")
        col = _blob(csr.col_indices, np.dtype("<i8"), f"{where}.sparse_csr.col_indices", "INT64")
        return _densify_csr(
            _widen(values, t.dtype), crow, col, shape, pad, where, max_dense_elements,
            (f"{where}.sparse_csr.crow_indices", f"{where}.sparse_csr.col_indices"),
        )
    raw = t.dense
    if len(raw) % wire_dt.itemsize:
        raise WireError(where, f"dense byte length {len(raw)} is not a multiple of {wire_dt.itemsize} ({name})")
    n = len(raw) // wire_dt.itemsize
    if shape and math.prod(shape) != n:
        raise WireError(where, f"dense byte length {len(raw)} does not match shape {shape} of {name}")
    arr = _widen(np.frombuffer(raw, dtype=wire_dt), t.dtype)
    return arr.reshape(shape or [n])


def _dtype_name(v: int) -> str:
    try:
        return pb.DType.Name(v)
    except ValueError:
        return "not a DType"


def _blob(raw: bytes, dt: np.dtype, where: str, name: str) -> np.ndarray:
    if len(raw) % dt.itemsize:
        raise WireError(where, f"byte length {len(raw)} is not a multiple of {dt.itemsize} ({name})")
    return np.frombuffer(raw, dtype=dt)


def _widen(arr: np.ndarray, proto_dtype: int) -> np.ndarray:
    """Wire array -> writable native float32/int64 (bf16 -> f32 by bit shift, int32 -> int64)."""
    if proto_dtype == pb.DTYPE_BFLOAT16:
        return (arr.astype(np.uint32) << 16).view(np.float32)
    return arr.astype(_PROTO_DTYPES[proto_dtype][2])  # astype copies: writable, native order


def _densify_csr(
    values: np.ndarray,
    crow: np.ndarray,
    col: np.ndarray,
    shape: list[int],
    pad: float,
    where: str,
    max_elems: int,
    index_fields: tuple[str, str],
) -> np.ndarray:
    crow_f, col_f = index_fields
    if len(shape) != 2:
        raise WireError(where, f"sparse CSR needs a 2-D shape, got {shape}")
    rows, cols = shape
    if rows * cols > max_elems:
        raise WireError(where, f"shape {shape} has {rows * cols} elements, over the cap of {max_elems}")
    if crow.size != rows + 1:
        raise WireError(crow_f, f"has {crow.size} entries, expected rows+1 = {rows + 1}")
    nnz = values.size
    if col.size != nnz:
        raise WireError(col_f, f"has {col.size} entries but there are {nnz} values")
    if crow[0] != 0 or crow[-1] != nnz or np.any(np.diff(crow) < 0):
        raise WireError(crow_f, f"must rise from 0 to nnz={nnz} without decreasing")
    if nnz and (int(col.min()) < 0 or int(col.max()) >= cols):
        raise WireError(col_f, f"index out of range [0, {cols})")
    row_ids = np.repeat(np.arange(rows), np.diff(crow))
    same_row = row_ids[1:] == row_ids[:-1]
    if np.any(col[1:][same_row] <= col[:-1][same_row]):
        raise WireError(col_f, "not strictly increasing within a row")
    out = np.full((rows, cols), pad, dtype=values.dtype)
    out[row_ids, col] = values
    return out


# ---------------------------------------------------------------------------------------------
# JSON-side helpers (SampleRequest.prompt / target_prompt_logprobs)


def tensor_data_from_json(
    obj: Any, where: str, *, pad: float = 0, max_dense_elements: int = DEFAULT_MAX_DENSE_ELEMENTS
) -> np.ndarray:
    """Decode a JSON ``TensorData`` dict into a dense float32 / int64 array."""
    if not isinstance(obj, Mapping):
        raise WireError(where, f"expected an object, got {type(obj).__name__}")
    dtype = obj.get("dtype")
    if dtype not in _JSON_DTYPES:
        raise WireError(f"{where}.dtype", f"unknown dtype {dtype!r} (expected 'int64' or 'float32')")
    values = _json_numbers(obj.get("data"), f"{where}.data", _JSON_DTYPES[dtype])
    shape = obj.get("shape")
    if shape is not None:
        if not isinstance(shape, list) or not all(type(s) is int and s >= 0 for s in shape):
            raise WireError(f"{where}.shape", "must be a list of non-negative integers")
    crow, col = obj.get("sparse_crow_indices"), obj.get("sparse_col_indices")
    if crow is not None or col is not None:
        if crow is None or col is None:
            raise WireError(where, "sparse_crow_indices and sparse_col_indices must be given together")
        if shape is None:
            raise WireError(f"{where}.shape", "is required for a sparse CSR tensor")
        crow_a = _json_numbers(crow, f"{where}.sparse_crow_indices", np.dtype(np.int64))
        col_a = _json_numbers(col, f"{where}.sparse_col_indices", np.dtype(np.int64))
        return _densify_csr(
            values, crow_a, col_a, shape, pad, where, max_dense_elements,
            (f"{where}.sparse_crow_indices", f"{where}.sparse_col_indices"),
        )
    if shape is not None and math.prod(shape) != values.size:
        raise WireError(where, f"{values.size} values do not match shape {shape}")
    return values.reshape(shape if shape is not None else [values.size])


def _json_numbers(data: Any, where: str, dt: np.dtype) -> np.ndarray:
    if not isinstance(data, list):
        raise WireError(where, f"expected a flat list of numbers, got {type(data).__name__}")
    if not all(type(x) in (int, float) for x in data):  # bool, None, str, nested lists
        raise WireError(where, "expected a flat list of numbers")
    if dt.kind == "i":
        if not all(type(x) is int or float(x).is_integer() for x in data):
            raise WireError(where, "int64 data holds a non-integer value")
        if data and not all(-(2**63) <= int(x) < 2**63 for x in data):
            raise WireError(where, "value out of int64 range")
        return np.array([int(x) for x in data], dtype=np.int64)
    return np.array(data, dtype=np.float64).astype(np.float32)


def model_input_tokens(obj: Any, where: str = "model_input") -> np.ndarray:
    """Concatenate the ``encoded_text`` chunks of a JSON ModelInput into an int64 array."""
    if not isinstance(obj, Mapping) or not isinstance(obj.get("chunks"), list):
        raise WireError(where, "expected an object with a 'chunks' list")
    parts = []
    for j, chunk in enumerate(obj["chunks"]):
        cf = f"{where}.chunks[{j}]"
        if not isinstance(chunk, Mapping):
            raise WireError(cf, f"expected an object, got {type(chunk).__name__}")
        kind = chunk.get("type", "encoded_text" if "tokens" in chunk else None)
        if kind in ("image", "image_asset_pointer", "dmel"):
            raise WireError(cf, f"{kind} chunks are not supported by this server")
        if kind != "encoded_text":
            raise WireError(f"{cf}.type", f"unknown chunk type {kind!r}")
        toks = chunk.get("tokens")
        if not isinstance(toks, list) or not all(type(t) is int and 0 <= t <= _MAX_TOKEN_ID for t in toks):
            raise WireError(f"{cf}.tokens", "expected a list of token ids in [0, 2**31)")
        parts.append(np.array(toks, dtype=np.int64))
    return np.concatenate(parts) if parts else np.empty(0, np.int64)


# ---------------------------------------------------------------------------------------------
# Response encoding


def _check_metric_key(key: str) -> None:
    if not isinstance(key, str) or key.count(":") != 1 or key.startswith(":"):
        raise ValueError(f"metric key {key!r} must be 'name:reduction' with exactly one colon")
    reduction = key.split(":")[1]
    if reduction not in METRIC_REDUCTIONS:
        raise ValueError(f"metric key {key!r}: reduction must be one of {sorted(METRIC_REDUCTIONS)}")


def _output_array(a: Any, where: str) -> tuple[np.ndarray, int]:
    arr = np.asarray(a)
    if arr.ndim == 0:
        raise ValueError(f"{where}: per-datum outputs need a leading dimension, got a scalar")
    if arr.dtype.kind == "f":
        return np.ascontiguousarray(arr, dtype="<f4"), pb.DTYPE_FLOAT32
    if arr.dtype.kind in "iub":
        return np.ascontiguousarray(arr, dtype="<i8"), pb.DTYPE_INT64
    raise ValueError(f"{where}: unsupported dtype {arr.dtype}")


def encode_forward_backward_output(
    loss_fn_outputs: Sequence[Mapping[str, Any]],
    metrics: Mapping[str, float],
    loss_fn_output_type: str = "ArrayRecord",
) -> bytes:
    """Serialise a ``tinker_public.ForwardBackwardOutput``: one ArrayRecord, one BatchedTensor per field."""
    for key in metrics:
        _check_metric_key(key)
    msg = pb.ForwardBackwardOutput(loss_fn_output_type=loss_fn_output_type)
    msg.metrics.update({k: float(v) for k, v in metrics.items()})
    rec = msg.loss_fn_outputs.add(type_tag=loss_fn_output_type, num_datums=len(loss_fn_outputs))
    names = list(loss_fn_outputs[0]) if loss_fn_outputs else []
    for i, out in enumerate(loss_fn_outputs):
        if sorted(out) != sorted(names):
            raise ValueError(f"loss_fn_outputs[{i}] has fields {sorted(out)}, expected {sorted(names)}")
    for name in names:
        arrays, dtype, trailing = [], None, None
        for i, out in enumerate(loss_fn_outputs):
            arr, dt = _output_array(out[name], f"loss_fn_outputs[{i}][{name!r}]")
            if i and (dt != dtype or list(arr.shape[1:]) != trailing):
                raise ValueError(f"loss_fn_outputs[{i}][{name!r}]: dtype/trailing shape differs from datum 0")
            arrays.append(arr)
            dtype, trailing = dt, list(arr.shape[1:])
        offsets = np.zeros(len(arrays) + 1, dtype="<i8")
        offsets[1:] = np.cumsum([a.nbytes for a in arrays])
        bt = rec.fields[name]
        bt.data = b"".join(a.tobytes() for a in arrays)
        bt.offsets = offsets.tobytes()
        bt.dtype = dtype
        bt.trailing_shape.extend(trailing)
    return msg.SerializeToString()


def _topk(rows: Sequence[Sequence[tuple[int, float]] | None], k: int | None, where: str) -> Any:
    width = k if k is not None else max((len(r) for r in rows if r), default=0)
    ids = np.zeros((len(rows), width), dtype="<i4")
    lps = np.full((len(rows), width), TOPK_MASK_LOGPROB, dtype="<f4")
    for i, row in enumerate(rows):
        if row is None:
            continue
        if len(row) > width:
            raise ValueError(f"{where}[{i}] has {len(row)} entries, more than k={width}")
        for c, (tok, lp) in enumerate(row):
            ids[i, c], lps[i, c] = tok, lp
    return pb.TopkLogprobs(token_ids=ids.tobytes(), logprobs=lps.tobytes(), k=width, length=len(rows))


_STOP_REASONS = {"stop": pb.STOP_REASON_STOP, "length": pb.STOP_REASON_LENGTH}


def encode_sample_response(
    sequences: Sequence[SampledSequenceWire],
    prompt_logprobs: Sequence[float | None] | None = None,
    *,
    topk_prompt_logprobs: Sequence[Sequence[tuple[int, float]] | None] | None = None,
    topk_k: int | None = None,
    prompt_cache_hit_tokens: int = 0,
    target_prompt_logprobs: Sequence[Sequence[float]] | None = None,
    target_prompt_csr: tuple[Sequence[int], Sequence[int]] | None = None,
    prompt_alt_tokens: tuple[Sequence[Sequence[int]], Sequence[Sequence[float]]] | None = None,
) -> bytes:
    """Serialise a ``tinker_public.SampleResponse`` (sequence ids are not on the wire).
    ``target_prompt_logprobs`` is dense ``[len(prompt) - 1, K]``; with ``target_prompt_csr`` (the request's
    crow and col indices) it is answered in that CSR layout, as the request was."""
    msg = pb.SampleResponse(prompt_cache_hit_tokens=prompt_cache_hit_tokens)
    for i, seq in enumerate(sequences):
        if seq.stop_reason not in _STOP_REASONS:
            raise ValueError(f"sequences[{i}].stop_reason must be 'stop' or 'length', got {seq.stop_reason!r}")
        tokens = np.asarray(seq.tokens, dtype=np.int64)
        logprobs = np.asarray(seq.logprobs, dtype="<f4")
        if tokens.ndim != 1 or logprobs.shape != tokens.shape:
            raise ValueError(f"sequences[{i}]: need 1-D tokens and logprobs of equal length")
        if tokens.size and (tokens.min() < 0 or tokens.max() > _MAX_TOKEN_ID):
            raise ValueError(f"sequences[{i}].tokens: token id out of int32 range")
        s = msg.sequences.add(stop_reason=_STOP_REASONS[seq.stop_reason])
        s.tokens = tokens.astype("<i4").tobytes()
        s.logprobs = logprobs.tobytes()
        if seq.topk_logprobs is not None:
            s.topk_sampled_logprobs.CopyFrom(_topk(seq.topk_logprobs, topk_k, f"sequences[{i}].topk_logprobs"))
    if prompt_logprobs is not None:
        msg.prompt_logprobs = np.array(
            [math.nan if v is None else v for v in prompt_logprobs], dtype="<f4"
        ).tobytes()
    if topk_prompt_logprobs is not None:
        msg.topk_prompt_logprobs.CopyFrom(_topk(topk_prompt_logprobs, topk_k, "topk_prompt_logprobs"))
    if target_prompt_logprobs is not None:
        msg.target_prompt_logprobs.CopyFrom(_float_tensor(target_prompt_logprobs, target_prompt_csr))
    if prompt_alt_tokens is not None:
        tokens, logprobs = (np.asarray(a) for a in prompt_alt_tokens)
        msg.prompt_alt_tokens.tokens.CopyFrom(pb.Tensor(dense=tokens.astype("<i8").tobytes(), dtype=pb.DTYPE_INT64,
                                                        shape=tokens.shape))
        msg.prompt_alt_tokens.logprobs.CopyFrom(_float_tensor(logprobs, None))
    return msg.SerializeToString()


def _float_tensor(dense: Sequence[Sequence[float]], csr: tuple[Sequence[int], Sequence[int]] | None) -> Any:
    """A 2-D float32 ``Tensor``: dense, or in a CSR layout (crow, col) with the listed cells' values."""
    values = np.asarray(dense, dtype="<f4")
    values = values if values.ndim == 2 else values.reshape(len(dense), 0)  # no rows, or rows of no cells
    if csr is None:
        return pb.Tensor(dense=values.tobytes(), dtype=pb.DTYPE_FLOAT32, shape=values.shape)
    crow, col = np.asarray(csr[0], dtype="<i8"), np.asarray(csr[1], dtype="<i8")
    rows = np.repeat(np.arange(len(crow) - 1), np.diff(crow))
    listed = values[rows, col] if col.size else np.zeros(0, "<f4")
    return pb.Tensor(sparse_csr=pb.SparseCsr(values=listed.astype("<f4").tobytes(), crow_indices=crow.tobytes(),
                                             col_indices=col.tobytes()),
                     dtype=pb.DTYPE_FLOAT32, shape=values.shape)

"""The client's side of the wire: encode requests, decode results (the inverse of codec.py).

The server and the official SDK exchange these bytes; the tests hold this module to the official
SDK's own encoder and decoder.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import zstandard

from . import tinker_public_pb2 as pb
from .codec import TOPK_MASK_LOGPROB, SampledSequenceWire, _PROTO_DTYPES

_STOP_REASON_NAMES = {pb.STOP_REASON_STOP: "stop", pb.STOP_REASON_LENGTH: "length"}


def _tensor(array: np.ndarray) -> Any:
    if array.dtype.kind == "f":
        return pb.Tensor(dense=np.ascontiguousarray(array, "<f4").tobytes(), dtype=pb.DTYPE_FLOAT32,
                         shape=list(array.shape))
    if array.dtype.kind in "iub":
        return pb.Tensor(dense=np.ascontiguousarray(array, "<i8").tobytes(), dtype=pb.DTYPE_INT64,
                         shape=list(array.shape))
    raise ValueError(f"unsupported dtype {array.dtype}: use float32 or int64 data")


def encode_forward_backward_request(
    model_id: str, seq_id: int, data: Sequence[tuple[Sequence[int], Mapping[str, np.ndarray]]],
    loss_fn: str, loss_fn_config: Mapping[str, float | str] | None = None, forward_only: bool = False,
    compress: bool = True,
) -> bytes:
    """A ``tinker_public.ForwardBackwardRequest`` (zstd-compressed unless told otherwise).

    `data` holds (tokens, loss_fn_inputs) per datum, inputs as numpy arrays.
    """
    msg = pb.ForwardBackwardRequest(model_id=model_id, seq_id=seq_id, loss_fn=loss_fn, forward_only=forward_only)
    for key, value in (loss_fn_config or {}).items():
        if isinstance(value, str):
            msg.loss_fn_config_v2[key].text = value
        else:
            msg.loss_fn_config[key] = float(value)
    for tokens, inputs in data:
        datum = msg.data.add()
        datum.model_input.add().encoded_text.tokens = np.asarray(tokens, dtype="<i4").tobytes()
        for name, array in inputs.items():
            datum.loss_fn_inputs[name].CopyFrom(_tensor(np.asarray(array)))
    raw = msg.SerializeToString()
    return zstandard.ZstdCompressor().compress(raw) if compress else raw


def _batched(bt: Any) -> list[np.ndarray]:
    _, wire_dtype, widened = _PROTO_DTYPES[bt.dtype]
    data = np.frombuffer(bt.data, dtype=wire_dtype)
    offsets = np.frombuffer(bt.offsets, dtype="<i8") // wire_dtype.itemsize
    trailing = [int(d) for d in bt.trailing_shape]
    per_row = math.prod(trailing) if trailing else 1
    arrays = []
    for start, end in zip(offsets[:-1], offsets[1:]):
        flat = data[start:end]
        if bt.dtype == pb.DTYPE_BFLOAT16:
            flat = (flat.astype(np.uint32) << 16).view(np.float32)
        arrays.append(flat.astype(widened).reshape([flat.size // per_row, *trailing]))
    return arrays


def decode_forward_backward_output(raw: bytes) -> tuple[list[dict[str, np.ndarray]], dict[str, float], str]:
    """(per-datum outputs, metrics, loss_fn_output_type) of a ``ForwardBackwardOutput``."""
    msg = pb.ForwardBackwardOutput()
    msg.ParseFromString(raw)
    outputs: list[dict[str, np.ndarray]] = []
    for record in msg.loss_fn_outputs:  # one per chunk; datums in order
        fields = {name: _batched(bt) for name, bt in record.fields.items()}
        for i in range(int(record.num_datums)):
            outputs.append({name: arrays[i] for name, arrays in fields.items()})
    return outputs, dict(msg.metrics), msg.loss_fn_output_type


def _topk_rows(t: Any) -> list[list[tuple[int, float]] | None]:
    ids = np.frombuffer(t.token_ids, dtype="<i4").reshape(t.length, t.k)
    lps = np.frombuffer(t.logprobs, dtype="<f4").reshape(t.length, t.k)
    rows: list[list[tuple[int, float]] | None] = []
    for r in range(t.length):
        if t.k == 0 or lps[r, 0] == TOPK_MASK_LOGPROB:
            rows.append(None)
            continue
        rows.append([(int(i), float(lp)) for i, lp in zip(ids[r], lps[r]) if lp != TOPK_MASK_LOGPROB])
    return rows


def decode_sample_response(raw: bytes) -> dict[str, Any]:
    """A ``SampleResponse`` as plain values: sequences, prompt_logprobs (None where not scored), top-k tables."""
    msg = pb.SampleResponse()
    msg.ParseFromString(raw)
    sequences = [
        SampledSequenceWire(
            tokens=np.frombuffer(s.tokens, dtype="<i4").astype(np.int64).tolist(),
            logprobs=np.frombuffer(s.logprobs, dtype="<f4").astype(np.float64).tolist(),
            stop_reason=_STOP_REASON_NAMES[s.stop_reason],
            topk_logprobs=_topk_rows(s.topk_sampled_logprobs) if s.HasField("topk_sampled_logprobs") else None,
        )
        for s in msg.sequences
    ]
    prompt_logprobs = None
    if msg.HasField("prompt_logprobs") and msg.prompt_logprobs:
        prompt_logprobs = [None if math.isnan(v) else float(v) for v in np.frombuffer(msg.prompt_logprobs, "<f4")]
    return {
        "sequences": sequences,
        "prompt_logprobs": prompt_logprobs,
        "topk_prompt_logprobs": _topk_rows(msg.topk_prompt_logprobs) if msg.HasField("topk_prompt_logprobs") else None,
        "prompt_cache_hit_tokens": int(msg.prompt_cache_hit_tokens),
    }

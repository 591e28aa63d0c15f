"""Tinker-compatible wire format: the ``tinker_public`` protobuf schema and numpy codecs.

``tinker_public_pb2`` is generated from ``tinker_public.proto`` by
``client_sdk/scripts/generate_proto.sh``; its descriptor is byte-identical to the one in the
official ``tinker`` SDK, so both can be imported in one process.
"""

from .codec import (
    DEFAULT_MAX_DECOMPRESSED_BYTES,
    DEFAULT_MAX_DENSE_ELEMENTS,
    METRIC_REDUCTIONS,
    TOPK_MASK_LOGPROB,
    DatumWire,
    ForwardBackwardWire,
    ProvenanceSpanWire,
    SampledSequenceWire,
    WireError,
    decode_body,
    decode_forward_backward_request,
    decode_tensor,
    encode_forward_backward_output,
    encode_sample_response,
    model_input_tokens,
    tensor_data_from_json,
)

__all__ = [
    "DEFAULT_MAX_DECOMPRESSED_BYTES",
    "DEFAULT_MAX_DENSE_ELEMENTS",
    "METRIC_REDUCTIONS",
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

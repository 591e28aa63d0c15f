"""The SampleResponse's distillation fields as the server encodes them, read back by the official SDK's own
decoder: target_prompt_logprobs dense or in the request's CSR layout, prompt_alt_tokens."""

from __future__ import annotations

import numpy as np
import torch
from loraplex.wire.codec import SampledSequenceWire, encode_sample_response
from tinker import types
from tinker.proto.response_conv import deserialize_sample_response

SEQUENCE = [SampledSequenceWire(tokens=[3], logprobs=[-0.5], stop_reason="length")]
LOGPROBS = [[-1.0, -2.0, 0.0], [-3.0, 0.0, -4.5]]  # dense [2, 3]; 0.0 where the request had -1


def test_dense_targets_and_alt_tokens_decode_as_sent():
    alt = ([[7, 7], [1, 9]], [[-0.1, -0.1], [-2.0, -3.0]])
    response = deserialize_sample_response(encode_sample_response(
        SEQUENCE, target_prompt_logprobs=LOGPROBS, prompt_alt_tokens=alt))
    target = response.target_prompt_logprobs
    assert target.dtype == "float32" and target.shape == [2, 3] and target.sparse_crow_indices is None
    np.testing.assert_array_equal(target.to_numpy(), LOGPROBS)
    assert response.prompt_alt_tokens.tokens.dtype == "int64"
    np.testing.assert_array_equal(response.prompt_alt_tokens.tokens.to_numpy(), alt[0])
    np.testing.assert_allclose(response.prompt_alt_tokens.logprobs.to_numpy(), alt[1])


def test_csr_targets_come_back_in_the_requests_layout():
    ids = torch.full((6, 4), -1)
    ids[0, 1], ids[4, 0], ids[4, 3] = 4, 5, 6
    asked = types.TensorData.from_torch_sparse(ids, pad_value=-1)
    assert asked.sparse_crow_indices is not None  # (the SDK sends CSR only when it is smaller)
    dense = np.zeros((6, 4))
    dense[0, 1], dense[4, 0], dense[4, 3] = -1.0, -2.0, -4.5
    response = deserialize_sample_response(encode_sample_response(
        SEQUENCE, target_prompt_logprobs=dense.tolist(),
        target_prompt_csr=(asked.sparse_crow_indices, asked.sparse_col_indices)))
    target = response.target_prompt_logprobs
    assert (target.sparse_crow_indices, target.sparse_col_indices, target.shape) == (
        asked.sparse_crow_indices, asked.sparse_col_indices, [6, 4])
    np.testing.assert_array_equal(target.data, [-1.0, -2.0, -4.5])  # the listed cells, in order
    assert response.prompt_alt_tokens is None

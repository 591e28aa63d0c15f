"""loraplex.wire.codec against the official tinker==0.38.0 SDK's own (de)serialisation."""

import asyncio
from types import SimpleNamespace

import numpy as np
import pytest
import zstandard

from loraplex.wire import codec
from loraplex.wire import tinker_public_pb2 as pb
from loraplex.wire.codec import SampledSequenceWire, WireError

tinker = pytest.importorskip("tinker")
from tinker import types as T  # noqa: E402
from tinker.lib.chunked_fwdbwd_helpers import combine_fwd_bwd_output_results  # noqa: E402
from tinker.proto import response_conv, tinker_public_pb2 as sdk_pb  # noqa: E402
from tinker.resources.training import AsyncTrainingResource  # noqa: E402
from tinker.types._pydantic_types.tensor_data import TensorData as TensorDataModel  # noqa: E402


def test_descriptor_identical_to_sdk():
    # Same file name and bytes: both modules share protobuf's default pool in one process.
    assert pb.DESCRIPTOR.serialized_pb == sdk_pb.DESCRIPTOR.serialized_pb


def sdk_forward_backward_body(datums, loss_fn, config, compress, forward_only=False):
    """Run the SDK's real AsyncTrainingResource.forward_backward and capture what it posts."""
    sent = {}

    async def post(path, *, body, options, cast_to):
        sent.update(path=path, body=body, headers=options["headers"])

    client = SimpleNamespace(_client_config=SimpleNamespace(proto_compress_fwdbwd=compress), post=post,
                             get=None, patch=None, put=None, delete=None, get_api_list=None)
    request = T.ForwardBackwardRequest(
        forward_backward_input=T.ForwardBackwardInput(data=datums, loss_fn=loss_fn, loss_fn_config=config),
        model_id="sess:train:0",
        seq_id=7,
    )
    asyncio.run(AsyncTrainingResource(client).forward_backward(request=request, forward_only=forward_only))
    assert sent["path"] == "/api/v1/forward_backward"
    return sent["body"], sent["headers"].get("Content-Encoding")


def csr_datum():
    """A (N, K) top-K datum whose target_tokens/weights the SDK sends as sparse CSR."""
    tt = np.zeros((6, 4), np.int64)
    tt[0, :2], tt[3, 1], tt[5, 3] = [11, 12], 13, 14
    w = (tt != 0).astype(np.float32) * 0.5
    try:
        import torch
        inputs = {"target_tokens": torch.from_numpy(tt), "weights": torch.from_numpy(w)}  # auto-sparsified
    except ImportError:
        def csr(a):
            rows, cols = np.nonzero(a)
            crow = np.searchsorted(rows, np.arange(a.shape[0] + 1)).tolist()
            return T.TensorData(data=a[rows, cols], dtype="int64" if a.dtype.kind == "i" else "float32",
                                shape=list(a.shape), sparse_crow_indices=crow, sparse_col_indices=cols.tolist())
        inputs = {"target_tokens": csr(tt), "weights": csr(w)}
    return T.Datum(model_input=T.ModelInput.from_ints([9, 8, 7, 6, 5, 4]), loss_fn_inputs=inputs), tt, w


@pytest.mark.parametrize("compress", [False, True])
def test_decode_request_made_by_sdk(compress):
    mi = T.ModelInput(chunks=[T.EncodedTextChunk(tokens=[1, 2, 3]), T.EncodedTextChunk(tokens=[70000, 5])])
    adv = np.array([0.5, -1.0, 2.0, 0.0, 3.25], np.float32)
    d0 = T.Datum(model_input=mi, loss_fn_inputs={"target_tokens": [2, 3, 70000, 5, 6], "advantages": adv,
                                                 "logprobs": [-0.1, -0.2, -0.3, -0.4, -0.5]})
    d1, tt, w = csr_datum()
    body, enc = sdk_forward_backward_body([d0, d1], "ppo", {"clip_low_threshold": 0.8, "mode": "seq"}, compress)
    assert enc == ("zstd" if compress else None)
    assert pb.ForwardBackwardRequest.FromString(codec.decode_body(body, enc)).data[1] \
        .loss_fn_inputs["target_tokens"].HasField("sparse_csr")  # the SDK really sent CSR

    fb = codec.decode_forward_backward_request(body, enc)
    assert (fb.model_id, fb.seq_id, fb.forward_only, fb.loss_fn) == ("sess:train:0", 7, False, "ppo")
    assert fb.loss_fn_config == {"clip_low_threshold": pytest.approx(0.8), "mode": "seq"}
    a, b = fb.data
    assert a.tokens.dtype == np.int64 and a.tokens.tolist() == [1, 2, 3, 70000, 5]
    assert a.loss_fn_inputs["target_tokens"].dtype == np.int64
    assert a.loss_fn_inputs["target_tokens"].tolist() == [2, 3, 70000, 5, 6]
    np.testing.assert_array_equal(a.loss_fn_inputs["advantages"], adv)
    assert a.loss_fn_inputs["logprobs"].dtype == np.float32
    assert b.tokens.tolist() == [9, 8, 7, 6, 5, 4]
    np.testing.assert_array_equal(b.loss_fn_inputs["target_tokens"], tt)
    np.testing.assert_array_equal(b.loss_fn_inputs["weights"], w)
    assert b.loss_fn_inputs["weights"].dtype == np.float32


def test_forward_only_legacy_config_and_narrow_dtypes():
    body, _ = sdk_forward_backward_body([csr_datum()[0]], "cross_entropy", None, False, forward_only=True)
    msg = pb.ForwardBackwardRequest.FromString(body)
    msg.loss_fn_config["beta"] = 0.05  # an older SDK: legacy map only
    t = msg.data[0].loss_fn_inputs
    t["bf"].CopyFrom(pb.Tensor(dense=np.array([0x3FC0, 0xC000], "<u2").tobytes(), dtype=pb.DTYPE_BFLOAT16, shape=[2]))
    t["i32"].CopyFrom(pb.Tensor(dense=np.array([[1, -2]], "<i4").tobytes(), dtype=pb.DTYPE_INT32, shape=[1, 2]))
    fb = codec.decode_forward_backward_request(msg.SerializeToString(), "identity")
    assert fb.forward_only and fb.loss_fn_config == {"beta": 0.05}
    inputs = fb.data[0].loss_fn_inputs
    assert inputs["bf"].dtype == np.float32 and inputs["bf"].tolist() == [1.5, -2.0]
    assert inputs["i32"].dtype == np.int64 and inputs["i32"].tolist() == [[1, -2]]


def good_request():
    m = pb.ForwardBackwardRequest(model_id="m", seq_id=1, loss_fn="cross_entropy")
    d = m.data.add()
    d.model_input.add().encoded_text.tokens = np.array([1, 2, 3, 4], "<i4").tobytes()
    d.loss_fn_inputs["weights"].CopyFrom(pb.Tensor(dense=np.ones(4, "<f4").tobytes(), dtype=pb.DTYPE_FLOAT32, shape=[4]))
    d.loss_fn_inputs["target_tokens"].CopyFrom(pb.Tensor(
        sparse_csr=pb.SparseCsr(values=np.array([5, 6], "<i8").tobytes(), crow_indices=np.array([0, 1, 1, 1, 2], "<i8").tobytes(),
                                col_indices=np.array([0, 1], "<i8").tobytes()), dtype=pb.DTYPE_INT64, shape=[4, 2]))
    return m


def test_good_request_decodes():
    (d,) = codec.decode_forward_backward_request(good_request().SerializeToString(), None).data
    assert d.loss_fn_inputs["target_tokens"].tolist() == [[5, 0], [0, 0], [0, 0], [0, 6]]


def _mutate(fn):
    m = good_request()
    fn(m.data[0])
    return m.SerializeToString()


W, TT = "data[0].loss_fn_inputs['weights']", "data[0].loss_fn_inputs['target_tokens']"
BAD = {
    "weights_len": (lambda d: setattr(d.loss_fn_inputs["weights"], "dense", b"\0" * 12), W,
                    f"{W}: dense byte length 12 does not match shape [4] of FLOAT32"),
    "weights_odd": (lambda d: setattr(d.loss_fn_inputs["weights"], "dense", b"\0" * 7), W, "multiple of 4"),
    "dtype_unspecified": (lambda d: setattr(d.loss_fn_inputs["weights"], "dtype", 0), W, "unknown dtype 0"),
    "dtype_unknown": (lambda d: setattr(d.loss_fn_inputs["weights"], "dtype", 9), W, "unknown dtype 9"),
    "csr_col_range": (lambda d: setattr(d.loss_fn_inputs["target_tokens"].sparse_csr, "col_indices",
                                        np.array([0, 2], "<i8").tobytes()), f"{TT}.sparse_csr.col_indices", "out of range"),
    "csr_crow": (lambda d: setattr(d.loss_fn_inputs["target_tokens"].sparse_csr, "crow_indices",
                                   np.array([0, 2, 1, 1, 2], "<i8").tobytes()), f"{TT}.sparse_csr.crow_indices", "0 to nnz"),
    "csr_shape": (lambda d: d.loss_fn_inputs["target_tokens"].ClearField("shape"), TT, "2-D shape"),
    "tokens_len": (lambda d: setattr(d.model_input[0].encoded_text, "tokens", b"\1" * 7),
                   "data[0].model_input.chunks[0].encoded_text.tokens", "multiple of 4"),
    "image": (lambda d: setattr(d.model_input.add().image, "data", b"png"), "data[0].model_input.chunks[1]",
              "data[0].model_input.chunks[1]: image chunks are not supported by this server"),
    "dmel": (lambda d: setattr(d.model_input.add().dmel, "dmel", b"x"), "data[0].model_input.chunks[1]", "dmel chunks"),
}


@pytest.mark.parametrize("case", BAD)
def test_malformed_request_names_field(case):
    fn, fld, msg = BAD[case]
    with pytest.raises(WireError) as e:
        codec.decode_forward_backward_request(_mutate(fn), None)
    assert e.value.field == fld and msg in str(e.value)


@pytest.mark.parametrize("body,enc,fld", [
    (good_request().SerializeToString()[:-5], None, "body"),  # truncated
    (b"\xff\xff\xff\xff", None, "body"),
    (b"not zstd", "zstd", "body"),
    (zstandard.ZstdCompressor().compress(good_request().SerializeToString())[:-4], "zstd", "body"),
    (good_request().SerializeToString(), "gzip", "Content-Encoding"),
])
def test_bad_body(body, enc, fld):
    with pytest.raises(WireError) as e:
        codec.decode_forward_backward_request(body, enc)
    assert e.value.field == fld and isinstance(e.value, ValueError)


@pytest.mark.parametrize("content_size", [True, False])
def test_zstd_bomb_over_cap(content_size):
    bomb = zstandard.ZstdCompressor(write_content_size=content_size).compress(b"\0" * (3 << 20))
    assert len(bomb) < 1000
    with pytest.raises(WireError, match=r"^body: .*over the 1048576-byte cap"):
        codec.decode_forward_backward_request(bomb, "zstd", max_decompressed_bytes=1 << 20)


def test_forward_backward_output_read_by_sdk():
    rng = np.random.default_rng(0)
    outs = [{"logprobs": rng.standard_normal(n).astype(np.float32), "topk": rng.standard_normal((n, 2)),
             "ids": np.arange(n)} for n in (3, 5)]
    body = codec.encode_forward_backward_output(outs, {"loss:sum": 12.5, "tokens:mean": 4.0})
    sdk = response_conv.deserialize_forward_backward_output(body)
    assert sdk.loss_fn_output_type == "ArrayRecord" and sdk.metrics == {"loss:sum": 12.5, "tokens:mean": 4.0}
    assert len(sdk.loss_fn_outputs) == 2
    for ours, theirs in zip(outs, sdk.loss_fn_outputs):
        assert theirs["logprobs"].dtype == "float32" and theirs["logprobs"].shape == [len(ours["logprobs"])]
        np.testing.assert_array_equal(theirs["logprobs"].to_numpy().reshape(theirs["logprobs"].shape), ours["logprobs"])
        assert theirs["topk"].shape == [len(ours["logprobs"]), 2]
        np.testing.assert_allclose(theirs["topk"].to_numpy().reshape(-1, 2), ours["topk"], rtol=1e-6)
        assert theirs["ids"].dtype == "int64" and theirs["ids"].tolist() == ours["ids"].tolist()
    combined = combine_fwd_bwd_output_results([sdk, sdk])  # the SDK's metric-key split must not crash
    assert combined.metrics == {"loss:sum": 25.0, "tokens:mean": 4.0}
    empty = response_conv.deserialize_forward_backward_output(codec.encode_forward_backward_output([], {"loss:sum": 0}))
    assert empty.loss_fn_outputs == []


@pytest.mark.parametrize("key", ["loss", "loss:sum:x", ":sum", "loss:avg"])
def test_bad_metric_key_rejected(key):
    with pytest.raises(ValueError):
        codec.encode_forward_backward_output([], {key: 1.0})


def test_sample_response_read_by_sdk():
    seqs = [SampledSequenceWire([5, 6, 2], [-0.5, -1.0, -0.25], "stop", topk_logprobs=[[(5, -0.5), (9, -2.0)], None, [(2, -0.25)]]),
            SampledSequenceWire(np.array([7, 70000]), np.array([-2.0, -3.0]), "length")]
    body = codec.encode_sample_response(seqs, [None, -0.5, -1.25], topk_prompt_logprobs=[None, [(3, -0.5)], [(4, -1.0)]],
                                        prompt_cache_hit_tokens=2)
    sdk = response_conv.deserialize_sample_response(body)
    a, b = sdk.sequences
    assert (a.tokens, a.logprobs, a.stop_reason) == ([5, 6, 2], [-0.5, -1.0, -0.25], "stop")
    assert a.topk_logprobs == [[(5, -0.5), (9, -2.0)], None, [(2, -0.25)]]
    assert (b.tokens, b.logprobs, b.stop_reason, b.topk_logprobs) == ([7, 70000], [-2.0, -3.0], "length", None)
    assert sdk.prompt_logprobs == [None, -0.5, -1.25]
    assert sdk.topk_prompt_logprobs == [None, [(3, -0.5)], [(4, -1.0)]]
    assert sdk.prompt_cache_hit_tokens == 2
    plain = response_conv.deserialize_sample_response(codec.encode_sample_response(seqs[1:], None))
    assert plain.prompt_logprobs is None and plain.sequences[0].logprobs == [-2.0, -3.0]
    with pytest.raises(ValueError):
        codec.encode_sample_response([SampledSequenceWire([1, 2], [-1.0], "stop")])


def test_json_helpers_on_sdk_sample_request():
    from tinker._compat import model_dump

    target = TensorDataModel(data=[5, 6, 7], dtype="int64", shape=[3, 2], sparse_crow_indices=[0, 1, 1, 3],
                             sparse_col_indices=[1, 0, 1])
    req = T.SampleRequest(prompt=T.ModelInput(chunks=[T.EncodedTextChunk(tokens=[1, 2]), T.EncodedTextChunk(tokens=[3, 4])]),
                          sampling_params=T.SamplingParams(max_tokens=3), num_samples=1, target_prompt_logprobs=target)
    js = model_dump(req, exclude_unset=False, exclude_none=True, mode="json")
    assert codec.model_input_tokens(js["prompt"], "prompt").tolist() == [1, 2, 3, 4]
    dense = codec.tensor_data_from_json(js["target_prompt_logprobs"], "target_prompt_logprobs", pad=-1)
    assert dense.dtype == np.int64 and dense.tolist() == [[-1, 5], [-1, -1], [6, 7]]
    w = codec.tensor_data_from_json({"data": [1, 2.5, 3, 4], "dtype": "float32", "shape": [2, 2]}, "w")
    assert w.dtype == np.float32 and w.tolist() == [[1, 2.5], [3, 4]]
    img = model_dump(T.ModelInput(chunks=[T.ImageChunk(data=b"\x89PNG", format="png")]), mode="json")
    with pytest.raises(WireError, match=r"^prompt.chunks\[0\]: image chunks are not supported"):
        codec.model_input_tokens(img, "prompt")


@pytest.mark.parametrize("obj,fld", [
    ({"data": [1], "dtype": "float16"}, "t.dtype"),
    ({"data": [1, "x"], "dtype": "int64"}, "t.data"),
    ({"data": [1.5], "dtype": "int64"}, "t.data"),
    ({"data": [True], "dtype": "float32"}, "t.data"),
    ({"data": [1, 2, 3], "dtype": "int64", "shape": [2, 2]}, "t"),
    ({"data": [1], "dtype": "int64", "shape": [1, 2], "sparse_crow_indices": [0, 1], "sparse_col_indices": [2]},
     "t.sparse_col_indices"),
    ({"data": [1], "dtype": "int64", "sparse_crow_indices": [0, 1], "sparse_col_indices": [0]}, "t.shape"),
    ([1, 2], "t"),
])
def test_bad_json_tensor(obj, fld):
    with pytest.raises(WireError) as e:
        codec.tensor_data_from_json(obj, "t")
    assert e.value.field == fld

"""The hand-written bad-input corpus: protobuf attacks on forward_backward and JSON attacks on the
other routes. Each names the field its error must name, and whether it carries a readable
(model_id, seq_id), in which case refusing it must not stall the model's later requests."""

from __future__ import annotations

import functools
import io
import json
import random
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import zstandard

from loraplex.wire import tinker_public_pb2 as pb
from tests.reliability.client import TOKENS, checkpoint_url

V1 = "/api/v1"
RAW_PROTOBUF = {"Content-Type": "application/x-protobuf"}
JSON = {"Content-Type": "application/json"}
HUGE = 10**30
LONG = "x" * 100_000  # an id or name no server keeps: the error must not echo it back


@dataclass(frozen=True)
class Target:
    """The attacker's resources: a fresh model (its next seq_id is `seq_id`), its session and a checkpoint."""

    model_id: str
    seq_id: int
    session_id: str
    checkpoint: str
    sampler: str = ""  # a sampling session on the base model (where the server samples)


@dataclass(frozen=True)
class Attack:
    name: str
    build: Callable[[Target], dict[str, Any]]  # httpx.request keyword arguments
    fields: tuple[str, ...]  # the error must name one of them
    uses_seq: bool = False


# --- protobuf ------------------------------------------------------------------------------------


def message(t: Target, tokens: list[int] = TOKENS) -> Any:
    """A valid ForwardBackwardRequest (one cross-entropy datum), for an attack to spoil."""
    msg = pb.ForwardBackwardRequest(model_id=t.model_id, seq_id=t.seq_id, loss_fn="cross_entropy")
    datum = msg.data.add()
    datum.model_input.add().encoded_text.tokens = np.asarray(tokens[:-1], "<i4").tobytes()
    n = len(tokens) - 1
    datum.loss_fn_inputs["target_tokens"].CopyFrom(
        pb.Tensor(dense=np.asarray(tokens[1:], "<i8").tobytes(), dtype=pb.DTYPE_INT64, shape=[n]))
    datum.loss_fn_inputs["weights"].CopyFrom(pb.Tensor(dense=np.ones(n, "<f4").tobytes(), dtype=pb.DTYPE_FLOAT32, shape=[n]))
    return msg


def spoiled(change: Callable[[Any], None]) -> Callable[[Target], dict[str, Any]]:
    def build(t: Target) -> dict[str, Any]:
        msg = message(t)
        change(msg)
        return {"method": "POST", "url": f"{V1}/forward_backward", "content": msg.SerializeToString(), "headers": RAW_PROTOBUF}
    return build


def raw(body: bytes | Callable[[Target], bytes], headers: dict[str, str] = RAW_PROTOBUF) -> Callable[[Target], dict[str, Any]]:
    return lambda t: {"method": "POST", "url": f"{V1}/forward_backward", "headers": headers,
                      "content": body(t) if callable(body) else body}


def inputs(msg: Any) -> Any:
    return msg.data[0].loss_fn_inputs


def tensor(name: str, **kw) -> Callable[[Any], None]:
    return lambda msg: inputs(msg)[name].CopyFrom(pb.Tensor(**kw))


def tokens(raw_tokens: bytes) -> Callable[[Any], None]:
    def change(msg: Any) -> None:
        msg.data[0].model_input[0].encoded_text.tokens = raw_tokens
    return change


def set_field(name: str, value: Any) -> Callable[[Any], None]:
    return lambda msg: setattr(msg, name, value)


def csr_over_cap(msg: Any) -> None:
    """A sparse weights tensor whose dense form would be 2**27 floats (512 MB), over the 2**26 cap."""
    rows = 1 << 14
    inputs(msg)["weights"].CopyFrom(pb.Tensor(
        sparse_csr=pb.SparseCsr(values=b"", crow_indices=np.zeros(rows + 1, "<i8").tobytes(), col_indices=b""),
        dtype=pb.DTYPE_FLOAT32, shape=[rows, 1 << 13]))


def image_chunk(msg: Any) -> None:
    msg.data[0].model_input.add().image.data = b"\x89PNG"


def unset_config_value(msg: Any) -> None:
    msg.loss_fn_config_v2["clip"].Clear()


def bad_crow(msg: Any) -> None:
    inputs(msg)["weights"].CopyFrom(pb.Tensor(
        sparse_csr=pb.SparseCsr(values=np.ones(2, "<f4").tobytes(), crow_indices=np.array([0, 5], "<i8").tobytes(),
                                col_indices=np.array([0, 1], "<i8").tobytes()), dtype=pb.DTYPE_FLOAT32, shape=[1, 19]))


@functools.cache
def zstd_bomb(declare_size: bool) -> bytes:
    """1 GiB of zeros in 32 KB of zstd; with or without the frame declaring its size."""
    zeros, out = bytes(1 << 20), io.BytesIO()
    compressor = zstandard.ZstdCompressor(level=1)
    if declare_size:
        with compressor.stream_writer(out, size=1 << 30, closefd=False) as writer:
            for _ in range(1024):
                writer.write(zeros)
        return out.getvalue()
    stream = compressor.compressobj()
    return b"".join([stream.compress(zeros) for _ in range(1024)] + [stream.flush()])


N = len(TOKENS) - 1
PROTOBUF_ATTACKS = [
    Attack("garbage bytes", raw(random.Random(0).randbytes(4096)), ("body",)),
    Attack("garbage as zstd", raw(random.Random(1).randbytes(4096), RAW_PROTOBUF | {"Content-Encoding": "zstd"}), ("body",)),
    Attack("truncated message", raw(lambda t: message(t).SerializeToString()[:57]), ("body",)),
    Attack("empty body", raw(b""), ("model_id",)),
    Attack("unknown content coding", raw(lambda t: message(t).SerializeToString(), RAW_PROTOBUF | {"Content-Encoding": "gzip"}),
           ("Content-Encoding",)),
    Attack("zstd bomb, size declared", raw(lambda t: zstd_bomb(True), RAW_PROTOBUF | {"Content-Encoding": "zstd"}), ("body",)),
    Attack("zstd bomb, size not declared", raw(lambda t: zstd_bomb(False), RAW_PROTOBUF | {"Content-Encoding": "zstd"}), ("body",)),
    Attack("dtype 99", spoiled(tensor("target_tokens", dense=np.zeros(N, "<i8").tobytes(), dtype=99, shape=[N])),
           ("target_tokens",), uses_seq=True),
    Attack("CSR tensor over its cap", spoiled(csr_over_cap), ("weights",), uses_seq=True),
    Attack("CSR rows that do not add up", spoiled(bad_crow), ("crow_indices",), uses_seq=True),
    Attack("token bytes not a multiple of 4", spoiled(tokens(b"\x01\x00\x00\x00\x02\x00\x00")), ("tokens",), uses_seq=True),
    Attack("negative token id", spoiled(tokens(np.array([5, -5, 7], "<i4").tobytes())), ("tokens",), uses_seq=True),
    Attack("token id over the vocabulary", spoiled(tokens(np.array([5, 2**31 - 1, 7], "<i4").tobytes())),
           ("model_input",), uses_seq=True),
    Attack("no tokens", spoiled(tokens(b"")), ("model_input",), uses_seq=True),
    Attack("more tokens than the context", spoiled(tokens(np.ones(100_000, "<i4").tobytes())), ("model_input",), uses_seq=True),
    Attack("huge shape", spoiled(tensor("target_tokens", dense=np.zeros(N, "<i8").tobytes(), dtype=pb.DTYPE_INT64,
                                        shape=[2**40])), ("target_tokens",), uses_seq=True),
    Attack("huge 2-D shape", spoiled(tensor("target_tokens", dense=np.zeros(N, "<i8").tobytes(), dtype=pb.DTYPE_INT64,
                                            shape=[2**62, 2**62])), ("target_tokens",), uses_seq=True),
    Attack("negative dimension", spoiled(tensor("weights", dense=np.ones(N, "<f4").tobytes(), dtype=pb.DTYPE_FLOAT32, shape=[-1])),
           ("weights",), uses_seq=True),
    Attack("weights shorter than the targets", spoiled(tensor("weights", dense=np.ones(3, "<f4").tobytes(), dtype=pb.DTYPE_FLOAT32,
                                                              shape=[3])), ("weights",), uses_seq=True),
    Attack("NaN weight", spoiled(tensor("weights", dense=np.full(N, np.nan, "<f4").tobytes(), dtype=pb.DTYPE_FLOAT32, shape=[N])),
           ("weights",), uses_seq=True),
    Attack("infinite weight", spoiled(tensor("weights", dense=np.full(N, np.inf, "<f4").tobytes(), dtype=pb.DTYPE_FLOAT32,
                                             shape=[N])), ("weights",), uses_seq=True),
    Attack("image chunk", spoiled(image_chunk), ("model_input",), uses_seq=True),
    Attack("loss config value unset", spoiled(unset_config_value), ("loss_fn_config_v2",), uses_seq=True),
    Attack("unknown loss", spoiled(set_field("loss_fn", "nope")), ("loss_fn",), uses_seq=True),
    Attack("100 KB loss name", spoiled(set_field("loss_fn", LONG)), ("loss_fn",), uses_seq=True),
    Attack("100 KB loss input name", spoiled(lambda msg: inputs(msg)[LONG].CopyFrom(inputs(msg)["weights"])),
           ("loss_fn_inputs",), uses_seq=True),
    Attack("seq_id 0", spoiled(set_field("seq_id", 0)), ("seq_id",)),
    Attack("negative seq_id", spoiled(set_field("seq_id", -5)), ("seq_id",)),
    Attack("100 KB model id in a protobuf", spoiled(set_field("model_id", LONG)), ("model_id",)),
]


# --- JSON ----------------------------------------------------------------------------------------


def post_json(route: str, body: Callable[[Target], Any], headers: dict[str, str] = JSON) -> Callable[[Target], dict[str, Any]]:
    """The body as JSON text written by Python's json (NaN and Infinity as the bare words)."""
    return lambda t: {"method": "POST", "url": f"{V1}/{route}", "headers": headers,
                      "content": json.dumps(body(t)).encode()}


def get_query(route: str, **params: Any) -> Callable[[Target], dict[str, Any]]:
    return lambda t: {"method": "GET", "url": f"{V1}/{route}", "params": params}


def optim(**adam: Any) -> Callable[[Target], dict[str, Any]]:
    return post_json("optim_step", lambda t: {"model_id": t.model_id, "seq_id": t.seq_id, "adam_params": adam})


def create_model(**lora: Any) -> Callable[[Target], dict[str, Any]]:
    return post_json("create_model", lambda t: {"session_id": t.session_id, "model_seq_id": 9, "base_model": "tiny",
                                                "lora_config": {"rank": 4, **lora}})


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


def nested_body(route: str, field: str, depth: int) -> Callable[[Target], dict[str, Any]]:
    return lambda t: {"method": "POST", "url": f"{V1}/{route}", "headers": JSON,
                      "content": f'{{"model_id": "{t.model_id}", "seq_id": {t.seq_id}, "{field}": {nested(depth)}}}'.encode()}


def client_metrics(metrics: Any, **more: Any) -> Callable[[Target], dict[str, Any]]:
    """POST /training_runs/<the target model>/metrics (the SDK's log_metrics)."""
    return lambda t: {"method": "POST", "url": f"{V1}/training_runs/{t.model_id}/metrics", "headers": JSON,
                      "content": json.dumps({"metrics": metrics, **more}).encode()}


def login(form: dict[str, str]) -> Callable[[Target], dict[str, Any]]:
    return lambda t: {"method": "POST", "url": "/dashboard/login", "data": form}


def dashboard(route: str, **params: Any) -> Callable[[Target], dict[str, Any]]:
    """GET /dashboard/api/<route> ({run}: the target model) with query `params`."""
    return lambda t: {"method": "GET", "url": f"/dashboard/api/{route.format(run=t.model_id)}", "params": params}


JSON_ATTACKS = [
    Attack("learning_rate NaN", optim(learning_rate=float("nan")), ("learning_rate",), uses_seq=True),
    Attack("beta1 Infinity", optim(learning_rate=1e-3, beta1=float("inf")), ("beta1",), uses_seq=True),
    Attack("learning_rate -Infinity", optim(learning_rate=float("-inf")), ("learning_rate",), uses_seq=True),
    Attack("learning_rate 1e308 * 10", lambda t: {"method": "POST", "url": f"{V1}/optim_step", "headers": JSON, "content":
           f'{{"model_id": "{t.model_id}", "seq_id": {t.seq_id}, "adam_params": {{"learning_rate": 1e309}}}}'.encode()},
           ("learning_rate",), uses_seq=True),
    Attack("unknown adam parameter", optim(learning_rate=1e-3, lr=1), ("adam_params",), uses_seq=True),
    Attack("adam_params as a list", post_json("optim_step", lambda t: {"model_id": t.model_id, "seq_id": t.seq_id,
                                                                       "adam_params": [1e-3, 0.9]}), ("adam_params",), uses_seq=True),
    Attack("seq_id 10**30", post_json("optim_step", lambda t: {"model_id": t.model_id, "seq_id": HUGE,
                                                               "adam_params": {"learning_rate": 1e-3}}), ("seq_id",)),
    Attack("seq_id NaN", post_json("optim_step", lambda t: {"model_id": t.model_id, "seq_id": float("nan")}), ("seq_id",)),
    Attack("model_id a number", post_json("optim_step", lambda t: {"model_id": 7, "seq_id": t.seq_id}), ("model_id",)),
    Attack("seq_id missing", post_json("optim_step", lambda t: {"model_id": t.model_id}), ("seq_id",)),
    Attack("text/plain body", post_json("optim_step", lambda t: {"model_id": t.model_id, "seq_id": t.seq_id},
                                        {"Content-Type": "text/plain"}), ("body", "Content-Type", "content-type")),
    Attack("JSON nested 100,000 deep", nested_body("optim_step", "adam_params", 100_000), ("body", "adam_params")),
    Attack("JSON nested 5,000 deep", nested_body("optim_step", "adam_params", 5_000), ("body", "adam_params")),
    Attack("not JSON", lambda t: {"method": "POST", "url": f"{V1}/optim_step", "headers": JSON, "content": b'{"model_id": '},
           ("body",)),
    Attack("lora seed 2**64", create_model(seed=2**64), ("seed",)),
    Attack("lora seed 2**70", create_model(seed=2**70), ("seed",)),
    Attack("lora rank 10**30", create_model(rank=HUGE), ("rank",)),
    Attack("lora alpha NaN", create_model(alpha=float("nan")), ("alpha",)),
    Attack("model_seq_id 10**30", post_json("create_model", lambda t: {"session_id": t.session_id, "model_seq_id": HUGE,
                                                                       "base_model": "tiny", "lora_config": {"rank": 4}}),
           ("model_seq_id",)),
    Attack("save ttl_seconds 10**30", post_json("save_weights", lambda t: {"model_id": t.model_id, "seq_id": t.seq_id,
                                                                           "path": "ttl", "ttl_seconds": HUGE}),
           ("ttl_seconds",), uses_seq=True),
    Attack("checkpoint ttl 10**30", lambda t: {"method": "PUT", "headers": JSON, "content": json.dumps({"ttl_seconds": HUGE}).encode(),
                                               "url": checkpoint_url(t.checkpoint, "/ttl")}, ("ttl_seconds",)),
    Attack("100 KB checkpoint name", post_json("save_weights", lambda t: {"model_id": t.model_id, "seq_id": t.seq_id,
                                                                          "path": LONG}), ("path",), uses_seq=True),
    Attack("load seq_id 10**30", post_json("load_weights", lambda t: {"path": t.checkpoint, "model_id": t.model_id,
                                                                      "seq_id": HUGE}), ("seq_id",)),
    Attack("sessions limit 10**30", get_query("sessions", limit=HUGE), ("limit",)),
    Attack("training_runs limit 10**30", get_query("training_runs", limit=HUGE), ("limit",)),
    Attack("checkpoints offset 10**30", get_query("checkpoints", offset=HUGE), ("offset",)),
    Attack("100 KB request id", post_json("retrieve_future", lambda t: {"request_id": LONG}), ("request_id",)),
    Attack("100 KB model id to get_info", post_json("get_info", lambda t: {"model_id": LONG}), ("model_id",)),
    Attack("100 KB session id", post_json("session_heartbeat", lambda t: {"session_id": LONG}), ("session_id",)),
    Attack("100 KB tinker path", post_json("weights_info", lambda t: {"tinker_path": LONG}), ("tinker_path",)),
    # client metrics of a run (api/routes/run_metrics.py)
    Attack("client metric NaN", client_metrics({"reward": float("nan")}), ("metrics",)),
    Attack("client metric 1e309", lambda t: {"method": "POST", "url": f"{V1}/training_runs/{t.model_id}/metrics",
                                             "headers": JSON, "content": b'{"metrics": {"reward": 1e309}}'}, ("metrics",)),
    Attack("client metric true", client_metrics({"reward": True}), ("metrics",)),
    Attack("client metric a string", client_metrics({"reward": "high"}), ("metrics",)),
    Attack("client metric a numeric string", client_metrics({"reward": "0.5"}), ("metrics",)),
    Attack("client metric name with a space", client_metrics({"my reward": 1.0}), ("metrics",)),
    Attack("100 KB client metric name", client_metrics({LONG: 1.0}), ("metrics",)),
    Attack("no client metrics", client_metrics({}), ("metrics",)),
    Attack("65 client metrics", client_metrics({f"m{i}": 1.0 for i in range(65)}), ("metrics",)),
    Attack("client metrics not an object", client_metrics([1.0]), ("metrics",)),
    Attack("client step -1", client_metrics({"reward": 1.0}, step=-1), ("step",)),
    Attack("client step 10**30", client_metrics({"reward": 1.0}, step=HUGE), ("step",)),
    Attack("client metrics of a 4 KB run id", lambda t: {  # 100 KB: longer than a URL may be
        "method": "POST", "url": f"{V1}/training_runs/{'x' * 4096}/metrics", "headers": JSON,
        "content": json.dumps({"metrics": {"reward": 1.0}}).encode()}, ("run_id",)),
    # the dashboard's login form and JSON API (api/dashboard/): the attacker's key as X-API-Key
    Attack("login without api_key", login({"next": "/dashboard"}), ("api_key",)),
    Attack("login with a 100 KB api_key", login({"api_key": LONG}), ("api_key",)),
    Attack("login as JSON", lambda t: {"method": "POST", "url": "/dashboard/login", "headers": JSON,
                                       "content": json.dumps({"api_key": "tml-x"}).encode()}, ("api_key",)),
    Attack("dashboard metrics since -2", dashboard("runs/{run}/metrics", since=-2), ("since",)),
    Attack("dashboard metrics since 10**30", dashboard("runs/{run}/metrics", since=HUGE), ("since",)),
    Attack("dashboard metrics since a word", dashboard("runs/{run}/metrics", since="last"), ("since",)),
    Attack("dashboard requests limit 0", dashboard("runs/{run}/requests", limit=0), ("limit",)),
    Attack("dashboard requests limit 10**30", dashboard("runs/{run}/requests", limit=HUGE), ("limit",)),
    Attack("dashboard requests state bogus", dashboard("runs/{run}/requests", state="bogus"), ("state",)),
    Attack("dashboard rl_groups good_above NaN", dashboard("runs/{run}/rl_groups", good_above="nan"), ("good_above",)),
    Attack("dashboard rl_groups since 10**30", dashboard("runs/{run}/rl_groups", since=HUGE), ("since",)),
    Attack("dashboard usage days 10**30", dashboard("usage", days=HUGE), ("days",)),
    Attack("dashboard usage days 0", dashboard("usage", days=0), ("days",)),
    Attack("dashboard runs tenant of 1000 characters", dashboard("runs", tenant="t" * 1000), ("tenant",)),
    Attack("dashboard runs include_deleted a word", dashboard("runs", include_deleted="maybe"), ("include_deleted",)),
    Attack("dashboard run of a 4 KB id", lambda t: {"method": "GET", "url": f"/dashboard/api/runs/{'x' * 4096}"},
           ("run_id",)),
    Attack("dashboard trajectory of a 4 KB id", lambda t: {
        "method": "GET", "url": f"/dashboard/api/runs/{t.model_id}/trajectories/{'x' * 4096}"}, ("session_id",)),
]


# --- asample (a server with vLLM) ------------------------------------------------------------------


def sample(**change: Any) -> Callable[[Target], dict[str, Any]]:
    """An asample request of the target's sampler with `change` applied (sampling_params.* by dotted key)."""
    def body(t: Target) -> dict[str, Any]:
        request: dict[str, Any] = {"sampling_session_id": t.sampler, "num_samples": 1,
                                   "prompt": {"chunks": [{"type": "encoded_text", "tokens": [5, 6, 7]}]},
                                   "sampling_params": {"max_tokens": 2}}
        for key, value in change.items():
            where, _, name = key.rpartition("__")
            (request[where] if where else request)[name] = value
        return request
    return post_json("asample", body)


SAMPLE_ATTACKS = [
    Attack("sampling seed 2**64", sample(sampling_params__seed=2**64), ("seed",)),
    Attack("sampling seed 2**70", sample(sampling_params__seed=2**70), ("seed",)),
    Attack("temperature NaN", sample(sampling_params__temperature=float("nan")), ("temperature",)),
    Attack("top_p Infinity", sample(sampling_params__top_p=float("inf")), ("top_p",)),
    Attack("top_k 10**30", sample(sampling_params__top_k=HUGE), ("top_k",)),
    Attack("max_tokens 10**30", sample(sampling_params__max_tokens=HUGE), ("max_tokens",)),
    Attack("stop token 10**30", sample(sampling_params__stop=[HUGE]), ("stop",)),
    Attack("num_samples 10**30", sample(num_samples=HUGE), ("num_samples",)),
    Attack("sample seq_id 10**30", sample(seq_id=HUGE), ("seq_id",)),
    Attack("prompt_logprobs_last_n 10**30", sample(prompt_logprobs_last_n=HUGE), ("prompt_logprobs_last_n",)),
    Attack("prompt token 2**40", sample(prompt={"chunks": [{"type": "encoded_text", "tokens": [2**40]}]}), ("prompt",)),
    Attack("prompt not a model input", sample(prompt=[1, 2, 3]), ("prompt",)),
    Attack("100 KB sampler id", sample(sampling_session_id=LONG), ("sampling_session_id",)),
]

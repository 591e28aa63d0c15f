"""The queue contract reads the rows and messages written before it: kinds and payloads, byte for byte."""

from __future__ import annotations

import json
import pickle

import pytest

from contract.configs import LoraConfig
from contract.kinds import RequestKind
from contract.payloads import (
    JSON_PAYLOADS, CreateModelPayload, LoadWeightsPayload, OptimStepPayload, RejectedPayload, SaveWeightsPayload,
)
from contract.queue import QueuedRequest
from loraplex.types import AdamParams


def test_kinds_are_the_strings_stored_in_rows():
    assert {k.value for k in RequestKind} == {
        "create_model", "forward", "forward_backward", "optim_step", "save_weights", "save_weights_for_sampler",
        "save_weights_external",
        "load_weights", "rejected", "sample"}
    assert json.dumps({"kind": RequestKind.OPTIM_STEP}) == '{"kind": "optim_step"}'


def test_a_queued_request_from_a_row_or_a_redis_message_gets_its_kind_typed():
    q = QueuedRequest("r", "t", "m", 1, "forward", 8)
    assert q.kind is RequestKind.FORWARD and q == QueuedRequest("r", "t", "m", 1, RequestKind.FORWARD, 8)
    assert pickle.loads(pickle.dumps(q)) == q
    with pytest.raises(ValueError):
        QueuedRequest("r", "t", "m", 1, "no_such_kind")


def test_every_kind_but_the_protobuf_and_sample_ones_has_a_json_payload_model():
    assert set(JSON_PAYLOADS) == set(RequestKind) - {RequestKind.FORWARD, RequestKind.FORWARD_BACKWARD,
                                                     RequestKind.SAMPLE}


# What the API stored before these models existed (json.dumps of a dict), for each kind.
STORED = [
    (CreateModelPayload(lora_config=LoraConfig(rank=8, seed=3)),
     {"lora_config": {"rank": 8, "alpha": 32.0, "seed": 3, "train_attn": True, "train_mlp": True,
                      "train_unembed": True}}),
    (OptimStepPayload(adam_params=AdamParams(learning_rate=1, weight_decay=0.1)),
     {"adam_params": {"learning_rate": 1, "beta1": 0.9, "beta2": 0.95, "eps": 1e-12, "weight_decay": 0.1,
                      "grad_clip_norm": 0.0}}),
    (SaveWeightsPayload(kind="training_state", ttl_seconds=None, user_metadata={"a": "b"}, name="n",
                        tinker_path="tinker://m/weights/n", storage_path="/data/t/m/weights/n"),
     {"kind": "training_state", "ttl_seconds": None, "user_metadata": {"a": "b"}, "name": "n",
      "tinker_path": "tinker://m/weights/n", "storage_path": "/data/t/m/weights/n"}),
    (SaveWeightsPayload(kind="sampler", ttl_seconds=60, user_metadata=None, sampling_session_id="s:sample:0",
                        ephemeral=True, name="snapshot-4", tinker_path="tinker://m/sampler_weights/snapshot-4",
                        storage_path="/data/t/m/sampler_weights/snapshot-4/seq-4"),
     {"kind": "sampler", "ttl_seconds": 60, "user_metadata": None, "sampling_session_id": "s:sample:0",
      "ephemeral": True, "name": "snapshot-4", "tinker_path": "tinker://m/sampler_weights/snapshot-4",
      "storage_path": "/data/t/m/sampler_weights/snapshot-4/seq-4"}),
    (LoadWeightsPayload(storage_path="/data/t/m/weights/n", optimizer=True, tinker_path="tinker://m/weights/n"),
     {"storage_path": "/data/t/m/weights/n", "optimizer": True, "tinker_path": "tinker://m/weights/n"}),
    (RejectedPayload(), {}),
]


@pytest.mark.parametrize("payload, before", STORED, ids=lambda v: type(v).__name__ if not isinstance(v, dict) else "")
def test_payloads_are_stored_as_before_and_read_back(payload, before):
    assert payload.to_bytes() == json.dumps(before).encode()
    assert type(payload).parse(json.dumps(before).encode()) == payload

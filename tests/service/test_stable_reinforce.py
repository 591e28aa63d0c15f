"""stable_reinforce's contract on a real embedded server (tiny model, vLLM sampler), driven by the
official `tinker` SDK: samplers created with record_stability_info record what they sampled, and a
training request's provenance (built and encoded by the SDK itself) is resolved against that
record, per tenant, for a day renewed on use (db/stability.py)."""

from __future__ import annotations

from datetime import timedelta

import numpy as np
import pytest
import sqlalchemy as sa
import tinker
from loraplex.wire.codec import decode_forward_backward_request
from tinker import types
from tinker.proto.request_conv import forward_backward_request_to_proto

from contract.errors import InvalidInputError
from contract.loss_specs import RECORDED_LOGPROBS, RECORDED_SEQUENCE
from contract.queue import Job, QueuedRequest
from db import stability
from db.models import RecordedSequence, Tenant, utcnow
from tests.servers import running_server
from workers.trainer.batch import prepare_request
from workers.trainer.executor import engine_input

pytestmark = pytest.mark.vllm  # the module's server runs the vLLM sampler
PROMPT = [5, 6, 7, 8, 9]
PARAMS = types.SamplingParams(max_tokens=6, temperature=1.0, stop=[])


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with running_server(tmp_path_factory.mktemp("loraplex")) as running:
        yield running


def tenant(server, name: str) -> tuple[str, str]:
    """A new tenant's (API key, id)."""
    key = server.new_tenant(name)
    with server.embedded.sessions() as s:
        return key, s.scalar(sa.select(Tenant.id).where(Tenant.name == name))


@pytest.fixture(scope="module")
def owner(server):
    return tenant(server, "sr-owner")


@pytest.fixture(scope="module")
def trained(server, owner):
    """A training client one optimizer step in (policy version 1), and a sample of 3 sequences from a
    sampler that records them."""
    tc = tinker.ServiceClient(base_url=server.base_url, api_key=owner[0]).create_lora_training_client(
        base_model="tiny", rank=8, seed=1).result()
    tokens = list(range(10, 30))
    sft = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                      loss_fn_inputs={"target_tokens": np.array(tokens[1:]), "weights": np.ones(19, np.float32)})
    tc.forward_backward([sft], "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    recording = tc.save_weights_and_get_sampling_client(record_stability_info=True).result()
    return tc, recording.sample(types.ModelInput.from_ints(PROMPT), 3, PARAMS).result()


def rows(server, ids) -> dict[str, RecordedSequence]:
    with server.embedded.sessions() as s:
        return {r.id: r for r in s.scalars(sa.select(RecordedSequence).where(RecordedSequence.id.in_(ids)))}


def test_a_recording_sampler_records_tokens_logprobs_and_policy_version(server, owner, trained):
    tc, response = trained
    recorded = rows(server, [seq.sequence_id for seq in response.sequences])
    assert len(recorded) == 3
    for seq in response.sequences:
        row = recorded[seq.sequence_id]
        assert np.frombuffer(row.tokens, "<i4").tolist() == seq.tokens
        assert np.frombuffer(row.logprobs, "<f4").tolist() == np.asarray(seq.logprobs, np.float32).tolist()
        assert np.frombuffer(row.prompt_tokens, "<i4").tolist() == PROMPT
        assert (row.tenant_id, row.policy_version) == (owner[1], 1) and seq.sequence_id.endswith("@v1")
        assert row.expires_at - row.created_at == timedelta(days=1)

    plain = tc.save_weights_and_get_sampling_client().result()  # record_stability_info defaults to False
    unrecorded = plain.sample(types.ModelInput.from_ints(PROMPT), 2, PARAMS).result()
    assert rows(server, [seq.sequence_id for seq in unrecorded.sequences]) == {}


def rl_datum(seq: types.SampledSequence, advantage: float, sequence_id: str | None = None) -> types.Datum:
    """As tinker-cookbook's rl_loop builds a stable_reinforce datum (naming `sequence_id` if given)."""
    n, ob = len(seq.tokens), len(PROMPT) - 1
    sequence_id = sequence_id or seq.sequence_id
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(PROMPT + seq.tokens[:-1]),
        loss_fn_inputs={"target_tokens": np.array([0] * ob + seq.tokens, np.int64),
                        "logprobs": np.array([0.0] * ob + seq.logprobs, np.float32),
                        "advantages": np.array([0.0] * ob + [advantage] * n, np.float32)},
    )
    return datum.with_provenance(
        model_input=[types.PromptProvenanceSpan(sequence_id=sequence_id, length=len(PROMPT)),
                     types.SampledProvenanceSpan(sequence_id=sequence_id, length=n - 1)],
        loss_fn_inputs=[types.PromptProvenanceSpan(sequence_id=sequence_id, offset=1, length=ob),
                        types.SampledProvenanceSpan(sequence_id=sequence_id, length=n)],
    )


def sdk_body(model_id: str, data: list[types.Datum]) -> bytes:
    """The forward_backward body the SDK sends (uncompressed)."""
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=data, loss_fn="stable_reinforce"),
        model_id=model_id, seq_id=3)
    return forward_backward_request_to_proto(request).SerializeToString()


def attach(server, tenant_id: str, body: bytes, now=None):
    with server.embedded.sessions() as s:
        result = stability.attach_recorded_inputs(s, tenant_id, decode_forward_backward_request(body, None), body, now)
        s.commit()
        return result


def test_provenance_resolves_to_the_record_and_renews_it(server, owner, trained):
    tc, response = trained
    ids = [seq.sequence_id for seq in response.sequences]
    with server.embedded.sessions() as s:  # as if sampled 20 hours ago
        s.execute(sa.update(RecordedSequence).where(RecordedSequence.id.in_(ids))
                  .values(expires_at=utcnow() + timedelta(hours=4)))
        s.commit()
    body = sdk_body(tc.model_id, [rl_datum(seq, a) for seq, a in zip(response.sequences, (1.0, -0.5, 0.0))])
    before = utcnow()
    wire, payload = attach(server, owner[1], body)

    ob = len(PROMPT) - 1
    for seq, datum in zip(response.sequences, wire.data):
        assert datum.loss_fn_inputs[RECORDED_LOGPROBS].tolist() == [0.0] * ob + np.float32(seq.logprobs).tolist()
        assert datum.loss_fn_inputs[RECORDED_SEQUENCE].tolist() == [0] * ob + [1] * len(seq.tokens)
    assert all(row.expires_at >= before + timedelta(days=1) for row in rows(server, ids).values())

    # the stored payload alone gives the trainer the same inputs (replays, workers: no lookups)
    job = Job(QueuedRequest("r", owner[1], tc.model_id, 3, "forward_backward", 0), payload)
    replayed = engine_input(job)
    for datum, ours in zip(replayed.data, wire.data):
        assert datum.loss_fn_inputs[RECORDED_LOGPROBS].tolist() == ours.loss_fn_inputs[RECORDED_LOGPROBS].tolist()
    prepare_request(0, replayed, vocab_size=512, max_len=2048)


def failure(server, tenant_id: str, body: bytes, now=None) -> InvalidInputError:
    with pytest.raises(InvalidInputError) as caught:
        attach(server, tenant_id, body, now)
    return caught.value


def test_unknown_foreign_and_expired_sequences_fail_naming_the_sequence(server, owner, trained):
    tc, response = trained
    seq = response.sequences[0]
    body = sdk_body(tc.model_id, [rl_datum(seq, 1.0)])
    _, stranger = tenant(server, "sr-stranger")
    foreign = failure(server, stranger, body)  # another tenant's sequence: as unknown as one never sampled
    assert foreign.field == "data[0].model_input_spans[0].sequence_id" and repr(seq.sequence_id) in foreign.message

    expired = failure(server, owner[1], body, now=utcnow() + timedelta(days=3))
    assert expired.field == "data[0].model_input_spans[0].sequence_id" and "expired" in expired.message

    never = failure(server, owner[1], sdk_body(tc.model_id, [rl_datum(seq, 1.0, sequence_id="nope:0:0@v1")]))
    assert never.field == "data[0].model_input_spans[0].sequence_id" and "'nope:0:0@v1'" in never.message


def test_a_sequence_not_used_for_a_day_is_pruned(server, owner, trained):
    tc, response = trained
    with server.embedded.sessions() as s:
        old = RecordedSequence(id="old:0:0@v0", tenant_id=owner[1], prompt_tokens=b"", tokens=b"", logprobs=b"",
                               created_at=utcnow() - timedelta(days=2), expires_at=utcnow() - timedelta(days=1))
        s.add(old)
        s.commit()
        assert stability.prune_expired(s, utcnow(), force=True) >= 1
        s.commit()
    assert rows(server, ["old:0:0@v0"]) == {}
    assert len(rows(server, [seq.sequence_id for seq in response.sequences])) == 3  # live ones stay


def test_claims_the_record_contradicts_and_client_sent_recorded_inputs_are_refused(server, owner, trained):
    tc, response = trained
    seq = response.sequences[0]
    wrong = rl_datum(seq, 1.0)
    targets = wrong.loss_fn_inputs["target_tokens"].to_numpy().copy()
    targets[-1] = (targets[-1] + 1) % 512
    tampered = types.Datum(model_input=wrong.model_input,
                           loss_fn_inputs={**wrong.loss_fn_inputs, "target_tokens": targets})
    tampered = tampered.with_provenance(model_input=wrong.model_input_spans, loss_fn_inputs=wrong.loss_fn_input_spans)
    error = failure(server, owner[1], sdk_body(tc.model_id, [tampered]))
    assert error.field == "data[0].loss_fn_input_spans[1]" and f"position {len(targets) - 1}" in error.message

    body = sdk_body(tc.model_id, [rl_datum(seq, 1.0)])
    wire, payload = attach(server, owner[1], body)
    error = failure(server, owner[1], payload)  # a body that already carries recorded inputs
    assert error.field == f"data[0].loss_fn_inputs[{RECORDED_LOGPROBS!r}]"

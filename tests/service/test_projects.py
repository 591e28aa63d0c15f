"""Projects, copy_weights, usage reports, the audit log and whoami, through the official `tinker` SDK
against a real embedded server: what a user of Tinker's project features does, unchanged."""

from __future__ import annotations

import warnings
from datetime import UTC, datetime, timedelta

import httpx
import numpy as np
import pytest
import sqlalchemy as sa
import tinker
from tinker import types

from db.models import ApiKey, utcnow
from db.tenants import hash_key

pytestmark = pytest.mark.slow
VOCAB = 512


@pytest.fixture(autouse=True)
def _quiet_deprecations():
    with warnings.catch_warnings():  # the SDK marks RestClient's admin methods deprecated (AdminClient's twins)
        warnings.simplefilter("ignore", FutureWarning)
        yield


def trained_client(service: tinker.ServiceClient) -> tinker.TrainingClient:
    tc = service.create_lora_training_client(base_model="tiny", rank=4, seed=2).result()
    seq = np.random.default_rng(0).integers(0, VOCAB, 10)
    datum = types.Datum(model_input=types.ModelInput.from_ints(seq[:-1].tolist()),
                        loss_fn_inputs={"target_tokens": seq[1:], "weights": np.ones(9, dtype=np.float32)})
    tc.forward_backward([datum], "cross_entropy")
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    return tc


def forward_loss(tc: tinker.TrainingClient) -> float:
    seq = np.arange(20, 30)
    datum = types.Datum(model_input=types.ModelInput.from_ints(seq[:-1].tolist()),
                        loss_fn_inputs={"target_tokens": seq[1:], "weights": np.ones(9, dtype=np.float32)})
    return tc.forward([datum], "cross_entropy").result().metrics["loss:sum"]


def test_a_project_named_by_the_sdk_files_runs_and_checkpoints(server, api_key):
    service = tinker.ServiceClient(base_url=server.base_url, api_key=api_key, project_id="vision",
                                   user_metadata={"recipe": "sl"})
    tc = trained_client(service)
    state = tc.save_state("s1", ttl_seconds=7200).result().path
    other = trained_client(tinker.ServiceClient(base_url=server.base_url, api_key=api_key))

    rest = tinker.RestClient(base_url=server.base_url, api_key=api_key)
    in_project = rest.list_training_runs(project_id="vision").result().training_runs
    assert [r.training_run_id for r in in_project] == [tc.model_id]
    assert rest.list_training_runs(project_id="nothing-here").result().training_runs == []
    session = rest.get_session(tc.model_id.split(":")[0]).result()
    assert session.user_metadata["recipe"] == "sl"

    # moving the other run's session into the project moves its run
    rest.assign_session_project(other.model_id.split(":")[0], "vision").result()
    moved = {r.training_run_id for r in rest.list_training_runs(project_id="vision").result().training_runs}
    assert moved == {tc.model_id, other.model_id}
    with pytest.raises(tinker.BadRequestError, match="project_id: a project name is"):
        rest.assign_session_project(other.model_id.split(":")[0], "no spaces").result()

    usage = rest.get_current_checkpoint_storage_usage(project_id="vision").result()
    assert [(i.project_id, i.checkpoint_count) for i in usage.data] == [("vision", 1)]
    assert usage.data[0].size_bytes > 0 and usage.data[0].size_gigabytes == usage.data[0].size_bytes / 1e9
    assert state


def test_copy_weights_into_the_clients_project(server, api_key):
    source = tinker.ServiceClient(base_url=server.base_url, api_key=api_key)
    tc = trained_client(source)
    state = tc.save_state("step-1", ttl_seconds=3600).result().path
    sampler = tc.save_weights_for_sampler("s-1").result().path
    loss = forward_loss(tc)

    archive = tinker.ServiceClient(base_url=server.base_url, api_key=api_key, project_id="archive")
    copied = archive.copy_weights(state).result()
    copied_sampler = archive.copy_weights(sampler, ttl_seconds=86400).result()
    assert copied.endswith("/weights/step-1") and copied != state
    assert copied_sampler.endswith("/sampler_weights/s-1")

    rest = tinker.RestClient(base_url=server.base_url, api_key=api_key)
    copy_run = rest.get_training_run_by_tinker_path(copied).result()
    assert copy_run.training_run_id in {r.training_run_id for r in
                                       rest.list_training_runs(project_id="archive").result().training_runs}
    [copy_ckpt] = rest.list_checkpoints(copy_run.training_run_id).result().checkpoints
    assert copy_ckpt.expires_at is None  # the source's TTL is not inherited
    [sampler_copy] = rest.list_checkpoints(copied_sampler.split("/")[2]).result().checkpoints
    assert sampler_copy.expires_at is not None

    # the source goes; the copy shares its files and still loads, to the same numbers
    rest.delete_checkpoint_from_tinker_path(state).result()
    resumed = source.create_training_client_from_state_with_optimizer(copied, user_metadata={"from": "copy"}).result()
    assert forward_loss(resumed) == pytest.approx(loss, rel=1e-5)
    assert rest.get_training_run(resumed.model_id).result().user_metadata == {"from": "copy"}
    assert rest.get_weights_info_by_tinker_path(copied).result().lora_rank == 4

    # the copy's run holds the copy only: training it is refused, naming why
    with httpx.Client(base_url=f"{server.base_url}/api/v1", headers={"X-API-Key": api_key}) as http:
        answer = http.post("/optim_step", json={"model_id": copy_run.training_run_id, "seq_id": 1,
                                                "adam_params": {"learning_rate": 1e-3}})
        assert answer.status_code == 400 and "cannot be trained" in answer.json()["detail"]
        # a retry of one copy (the SDK reuses its X-Idempotency-Key) answers the first copy
        body = {"source_path": sampler, "destination_project_id": "archive"}
        first = http.post("/copy_weights", json=body, headers={"X-Idempotency-Key": "retry-1"}).json()
        again = http.post("/copy_weights", json=body, headers={"X-Idempotency-Key": "retry-1"}).json()
        assert first == again
        assert http.post("/copy_weights", json={"source_path": sampler}).status_code == 400
        bad_ttl = http.post("/copy_weights", json={**body, "ttl_seconds": 60})
        assert bad_ttl.status_code == 422 and "ttl_seconds" in bad_ttl.json()["detail"]

    audit = rest.get_audit_log(event_type="checkpoints").result()
    copies = [e for e in audit.entries if e.event == "checkpoint_copy"]
    assert {e.tinker_path for e in copies} >= {copied, copied_sampler}
    assert all(e.event_details["actor"].startswith("api_key:tml-") for e in copies)
    projects = rest.get_audit_log(event_type="projects").result()
    assert "project_create" in {e.event for e in projects.entries}


def test_another_tenants_checkpoint_cannot_be_copied(server, api_key):
    tc = trained_client(tinker.ServiceClient(base_url=server.base_url, api_key=api_key))
    state = tc.save_state("mine").result().path
    tinker.RestClient(base_url=server.base_url, api_key=api_key).publish_checkpoint_from_tinker_path(state).result()

    stranger_key = server.new_tenant()
    stranger = tinker.ServiceClient(base_url=server.base_url, api_key=stranger_key, project_id="archive")
    with pytest.raises(tinker.NotFoundError, match="source_path: no checkpoint"):
        stranger.copy_weights(state).result()  # published or not: as if it did not exist
    rest = tinker.RestClient(base_url=server.base_url, api_key=stranger_key)
    assert rest.get_current_checkpoint_storage_usage().result().data == []
    assert rest.get_audit_log().result().entries == []  # the owner's events are the owner's
    # the same project name is the stranger's own project: nothing of the owner's is in it
    assert rest.list_training_runs(project_id="archive").result().training_runs == []


def test_billing_usage_counts_tokens_by_kind(server, api_key):
    service = tinker.ServiceClient(base_url=server.base_url, api_key=api_key, project_id="billed")
    tc = trained_client(service)
    tc.save_state("b1").result()
    now = datetime.now(UTC).replace(minute=0, second=0, microsecond=0)
    rest = tinker.RestClient(base_url=server.base_url, api_key=api_key)
    usage = rest.get_billing_usage(now, now + timedelta(hours=1)).result()
    session_id = tc.model_id.split(":")[0]
    mine = [e for e in usage.data if e.session_id == session_id]
    training = [e for e in mine if e.event_info.type == "training"]
    assert [e.event_info.token_count for e in training] == [9]  # one forward_backward of 9 tokens
    assert training[0].project_id == "billed" and training[0].base_model == "loraplex/tiny"
    assert [e.event_info.count for e in mine if e.event_info.type == "checkpoint"] == [1]
    assert session_id in usage.sessions
    with pytest.raises(tinker.BadRequestError, match="starting_on: must be on a UTC hour boundary"):
        rest.get_billing_usage(now + timedelta(minutes=5), now + timedelta(hours=1)).result()
    with pytest.raises(tinker.BadRequestError, match="ending_before: at most 14 days"):
        rest.get_billing_usage(now - timedelta(days=15), now).result()


def test_whoami_reads_the_exchanged_token_and_plain_keys_still_work(server, api_key):
    rest = tinker.RestClient(base_url=server.base_url, api_key=api_key)
    me = rest.whoami().result()
    assert me.user_urn.startswith("loraplex:api_key:") and me.org_urn.startswith("tml:organization:tenant-")
    assert me.email is None

    with httpx.Client(base_url=f"{server.base_url}/api/v1") as http:
        assert http.post("/client/config", json={"sdk_version": "0.38.0"}).json()["pjwt_auth_enabled"] is True
        token = http.post("/auth/token", json={}, headers={"X-API-Key": api_key}).json()["jwt"]
        assert http.get("/sessions", headers={"X-API-Key": token}).status_code == 200
        assert http.get("/sessions", headers={"X-API-Key": api_key}).status_code == 200  # a plain key too
        forged = token[:-4] + ("AAAA" if not token.endswith("AAAA") else "BBBB")
        refused = http.get("/sessions", headers={"X-API-Key": forged})
        assert refused.status_code == 401 and 'error="invalid_token"' in refused.headers["www-authenticate"]
        # a token is exchanged for an API key, not for another token
        assert http.post("/auth/token", json={}, headers={"X-API-Key": token}).status_code == 401

        # revoking the key ends its tokens at once, though they have not expired
        doomed_key = server.new_tenant()
        doomed = http.post("/auth/token", json={}, headers={"X-API-Key": doomed_key}).json()["jwt"]
        assert http.get("/sessions", headers={"X-API-Key": doomed}).status_code == 200
        with server.embedded.sessions() as s:
            s.execute(sa.update(ApiKey).where(ApiKey.key_hash == hash_key(doomed_key)).values(revoked_at=utcnow()))
            s.commit()
        assert http.get("/sessions", headers={"X-API-Key": doomed}).status_code == 401

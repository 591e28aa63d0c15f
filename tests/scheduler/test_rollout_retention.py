"""Rollout retention, set with `loraplex-admin quotas set` on a real embedded server (tiny model, its vLLM
sampler) and recorded through the official `openai` SDK: the TTL sweep deletes a tenant's stale
trajectories only, the size quota refuses new recordings with a 403 naming it, and an ephemeral sampler
snapshot an agent samples through the inference API is kept as one a sampling client samples is."""

from __future__ import annotations

import re
from datetime import timedelta

import loraplex
import openai
import pytest
import sqlalchemy as sa

from db.models import Checkpoint, RolloutSample, RolloutTrajectory, RolloutTurn, utcnow
from scheduler.janitor import sweep
from tests.admin.cli import admin_cli, printed_key
from tests.servers import running_server

pytestmark = pytest.mark.vllm  # the module's server runs the vLLM sampler

GRACE = 60.0
MESSAGES = [{"role": "user", "content": "What is 2 + 3?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with running_server(tmp_path_factory.mktemp("loraplex")) as running:
        yield running


@pytest.fixture(scope="module")
def admin(server):
    return admin_cli(server.settings.data_dir)


def tenant_key(admin, name: str) -> str:
    return printed_key(admin("tenants", "create", name))


def agent(server, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/oai/api/v1", api_key=key, max_retries=0)


def call(client: openai.OpenAI, session: str, model: str = "tiny") -> None:
    client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=4,
                                   extra_headers={"X-Loraplex-Session": session})


def rows(server, table) -> int:
    with server.embedded.sessions() as s:
        return s.scalar(sa.select(sa.func.count()).select_from(table))


def test_ttl_deletes_only_that_tenants_stale_trajectories(server, admin):
    alice, bob = tenant_key(admin, "alice-ttl"), tenant_key(admin, "bob-ttl")
    for key, session in ((alice, "stale"), (alice, "fresh"), (bob, "stale")):
        call(agent(server, key), session)
    shown = admin("quotas", "set", "alice-ttl", "--rollout-ttl-seconds", "3600")
    assert re.search(r"rollout_ttl_seconds +│ 3600 ", shown)
    with server.embedded.sessions() as s:  # both "stale" trajectories were last touched two hours ago
        s.execute(sa.update(RolloutTrajectory).where(RolloutTrajectory.session_id == "stale")
                  .values(updated_at=utcnow() - timedelta(hours=2)))
        s.commit()
    turns, samples = rows(server, RolloutTurn), rows(server, RolloutSample)

    assert "1 expired rollout trajectories deleted" in admin("checkpoints", "prune-expired")
    alice_store = loraplex.RolloutsClient(loraplex.ServiceClient(base_url=server.base_url, api_key=alice))
    bob_store = loraplex.RolloutsClient(loraplex.ServiceClient(base_url=server.base_url, api_key=bob))
    assert [t.session_id for t in alice_store.list_trajectories()] == ["fresh"]
    assert [t.session_id for t in bob_store.list_trajectories()] == ["stale"]  # bob set no TTL
    assert (rows(server, RolloutTurn), rows(server, RolloutSample)) == (turns - 1, samples - 1)
    assert "0 expired rollout trajectories deleted" in admin("checkpoints", "prune-expired")


def test_size_quota_refuses_new_recordings_naming_it(server, admin):
    client = agent(server, tenant_key(admin, "carol-quota"))
    call(client, "first")  # nothing stored yet: under any limit
    admin("quotas", "set", "carol-quota", "--max-rollout-bytes", "1")
    turns = rows(server, RolloutTurn)
    with pytest.raises(openai.PermissionDeniedError, match=r"quota max_rollout_bytes=1 would be exceeded: \d+ bytes"):
        call(client, "first")
    with pytest.raises(openai.PermissionDeniedError, match="max_rollout_bytes"):
        call(client, "another")
    assert rows(server, RolloutTurn) == turns
    admin("quotas", "set", "carol-quota", "--max-rollout-bytes", "none")
    call(client, "another")
    assert rows(server, RolloutTurn) == turns + 1


def test_inference_api_use_keeps_an_ephemeral_snapshot(server, admin):
    key = tenant_key(admin, "dave-agent")
    training = loraplex.ServiceClient(base_url=server.base_url, api_key=key).create_lora_training_client(
        base_model="tiny", rank=4)
    for _ in range(2):
        training.save_weights_and_get_sampling_client()
    sessions = server.embedded.sessions
    with sessions() as s:
        older, newer = s.scalars(sa.select(Checkpoint).where(Checkpoint.model_id == training.model_id)
                                 .order_by(Checkpoint.created_at)).all()
        assert older.ephemeral and newer.ephemeral
        path, folder = older.tinker_path, older.storage_path
    call(agent(server, key), "pinned", model=path)  # an agent pinned to the superseded snapshot

    def age(table, column, where, graces: int = 2) -> None:
        with sessions() as s:
            s.execute(sa.update(table).where(where).values({column: utcnow() - timedelta(seconds=graces * GRACE)}))
            s.commit()

    def kept() -> bool:
        with sessions() as s:
            return s.scalar(sa.select(Checkpoint).where(Checkpoint.tinker_path == path)) is not None

    age(Checkpoint, "created_at", Checkpoint.tinker_path == path, graces=3)  # superseded, past the grace period
    age(Checkpoint, "created_at", (Checkpoint.model_id == training.model_id) & (Checkpoint.tinker_path != path))
    sweep(sessions, GRACE)
    assert kept()  # sampled through the inference API within the grace period
    age(RolloutTurn, "created_at", RolloutTurn.adapter_path == folder)
    sweep(sessions, GRACE)
    assert not kept()

"""`loraplex-admin` end to end against the database of a running server, and every quota at the API:
the exact status, the limit named, and nothing changed by a refused request."""

from __future__ import annotations

from pathlib import Path

import httpx
import numpy as np
import pytest
import sqlalchemy as sa
import tinker
from peft import PeftModel
from tinker import types
from transformers import AutoModelForCausalLM

from tests.admin.cli import admin_cli, printed_key
from db.models import Checkpoint, Request, utcnow
from tests.servers import running_server
from tests.waiting import wait_until

pytestmark = pytest.mark.vllm  # the module's server runs the vLLM sampler (sampling quotas)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with running_server(tmp_path_factory.mktemp("loraplex")) as running:
        yield running


@pytest.fixture(scope="module")
def admin(server):
    return admin_cli(server.settings.data_dir)


def new_tenant(admin, name: str) -> str:
    return printed_key(admin("tenants", "create", name))


def post(server, key: str, route: str, body) -> httpx.Response:
    return httpx.post(f"{server.base_url}/api/v1/{route}", json=body, headers={"X-API-Key": key}, timeout=60)


def request_count(server) -> int:
    """Requests accepted to run (a refused one is recorded only to free its seq_id: kind 'rejected')."""
    with server.embedded.sessions() as s:
        return s.scalar(sa.select(sa.func.count()).select_from(Request).where(Request.kind != "rejected"))


def expired(server, tinker_path: str) -> bool:
    """Whether the checkpoint's TTL has run out, as prune-expired tells (scheduler/janitor.py)."""
    with server.embedded.sessions() as s:
        return s.scalar(sa.select(sa.func.count()).select_from(Checkpoint)
                        .where(Checkpoint.tinker_path == tinker_path, Checkpoint.expires_at <= utcnow())) == 1


def datum(n: int) -> types.Datum:
    tokens = list(range(10, 11 + n))
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": np.array(tokens[1:]), "weights": np.ones(n, np.float32)})


def test_tenants_and_keys(server, admin):
    key = new_tenant(admin, "carol")
    assert key.startswith("tml-")
    assert "carol" in admin("tenants", "list")
    assert post(server, key, "create_session", {"tags": []}).status_code == 200
    second = printed_key(admin("keys", "issue", "carol"))
    listing = admin("keys", "list", "carol")
    assert key[:12] in listing and second[:12] in listing

    admin("keys", "revoke", key[:12])
    assert post(server, key, "create_session", {"tags": []}).status_code == 401  # at once
    assert post(server, second, "create_session", {"tags": []}).status_code == 200
    admin("tenants", "disable", "carol")
    assert post(server, second, "create_session", {"tags": []}).status_code == 401
    admin("tenants", "enable", "carol")
    assert post(server, second, "create_session", {"tags": []}).status_code == 200
    assert "no tenant" in admin("keys", "issue", "nobody", ok=False)


def test_model_quotas(server, admin):
    key = new_tenant(admin, "dave")
    admin("quotas", "set", "dave", "--max-live-models", "1", "--max-lora-rank", "4")
    assert "max_live_models" in admin("quotas", "show", "dave")
    client = tinker.ServiceClient(base_url=server.base_url, api_key=key)
    with pytest.raises(tinker.PermissionDeniedError, match="max_lora_rank=4"):
        client.create_lora_training_client(base_model="tiny", rank=8).result()
    client.create_lora_training_client(base_model="tiny", rank=4).result()
    before = request_count(server)
    with pytest.raises(tinker.PermissionDeniedError, match="max_live_models=1"):
        client.create_lora_training_client(base_model="tiny", rank=4).result()
    assert request_count(server) == before  # nothing stored
    assert len(tinker.ServiceClient(base_url=server.base_url, api_key=key).create_rest_client()
               .list_training_runs().result().training_runs) == 1
    admin("quotas", "set", "dave", "--max-live-models", "none")
    client.create_lora_training_client(base_model="tiny", rank=4).result()


def test_token_and_storage_quotas(server, admin):
    key = new_tenant(admin, "erin")
    admin("quotas", "set", "erin", "--train-tokens-per-day", "30", "--sample-tokens-per-day", "20",
          "--max-checkpoint-bytes", "1")
    client = tinker.ServiceClient(base_url=server.base_url, api_key=key)
    training = client.create_lora_training_client(base_model="tiny", rank=4).result()
    training.forward_backward([datum(20)], "cross_entropy").result()
    before = request_count(server)
    with pytest.raises(tinker.PermissionDeniedError, match="train_tokens_per_day=30"):
        training.forward_backward([datum(20)], "cross_entropy").result()
    assert request_count(server) == before

    training.save_state("first").result()  # 0 bytes stored before it: allowed
    with pytest.raises(tinker.PermissionDeniedError, match="max_checkpoint_bytes=1"):
        training.save_state("second").result()
    admin("quotas", "set", "erin", "--max-checkpoint-bytes", "none")

    sampler = training.save_weights_and_get_sampling_client()
    prompt = types.ModelInput.from_ints([5, 6, 7, 8, 9])
    sampler.sample(prompt, 1, types.SamplingParams(max_tokens=10, stop=[])).result()  # 5 + 10 <= 20
    with pytest.raises(tinker.PermissionDeniedError, match="sample_tokens_per_day=20"):
        sampler.sample(prompt, 1, types.SamplingParams(max_tokens=10, stop=[])).result()
    usage = admin("usage", "--tenant", "erin")
    assert "erin" in usage and " 20 " in usage and " 15 " in usage  # 20 tokens trained, 5 + 10 sampled


def test_concurrency_quota_answers_429(server, admin):
    key = new_tenant(admin, "frank")
    admin("quotas", "set", "frank", "--max-concurrent-requests", "1")
    session = post(server, key, "create_session", {"tags": []}).json()["session_id"]
    create = {"session_id": session, "model_seq_id": 0, "base_model": "tiny", "lora_config": {"rank": 4}}
    future = post(server, key, "create_model", create).json()
    post(server, key, "retrieve_future", {"request_id": future["request_id"]})
    model_id = future["model_id"]
    # seq_id 5 waits for 1-4, which never come: one request stays in flight
    waiting = post(server, key, "optim_step", {"model_id": model_id, "seq_id": 5})
    assert waiting.status_code == 200
    refused = post(server, key, "optim_step", {"model_id": model_id, "seq_id": 6})
    assert refused.status_code == 429 and "max_concurrent_requests=1" in refused.text
    assert refused.headers["retry-after"] == "1"


def test_checkpoint_commands(server, admin, tmp_path, tiny_model_path):
    key = new_tenant(admin, "gina")
    client = tinker.ServiceClient(base_url=server.base_url, api_key=key)
    training = client.create_lora_training_client(base_model="tiny", rank=4, seed=1).result()
    training.forward_backward([datum(8)], "cross_entropy").result()
    training.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    keep = training.save_state("keep").result().path
    sampler = training.save_weights_for_sampler("snap").result().path
    short = training.save_state("short", ttl_seconds=1).result().path
    listing = admin("checkpoints", "list", "--tenant", "gina")
    assert all(path in listing for path in (keep, sampler, short))
    assert keep in admin("checkpoints", "list", "--run", training.model_id)

    for path, dest in ((keep, tmp_path / "state"), (sampler, tmp_path / "sampler")):
        admin("checkpoints", "export", path, str(dest))
        assert (Path(dest) / "adapter_config.json").is_file()
        PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_path), dest)

    wait_until(lambda: expired(server, short), f"{short} to pass its expiry", timeout=60)
    assert "1 expired checkpoints and 0 ephemeral snapshots deleted" in admin("checkpoints", "prune-expired")
    listing = admin("checkpoints", "list", "--tenant", "gina")
    assert short not in listing and keep in listing
    admin("checkpoints", "delete", keep)
    assert keep not in admin("checkpoints", "list", "--tenant", "gina")
    assert "gina" in admin("usage")

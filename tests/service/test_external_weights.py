"""save_weights_external through the official `tinker` SDK: a trained run exported as a Hugging Face
folder (merged weights, tokenizer) beside its PEFT adapter, listed as an "external" checkpoint,
downloaded file by file from signed URLs with no API key, and loaded in transformers with the
service's own numbers. (Loading it in vLLM: test_external_weights_vllm.py.)"""

from __future__ import annotations

import hashlib
import io
import json
import os
import subprocess
import sys
import tarfile
import urllib.error
import urllib.request
from datetime import UTC, datetime, timedelta
from pathlib import Path
from urllib.parse import parse_qs, urlencode, urlsplit, urlunsplit

import httpx
import numpy as np
import pyrage
import pytest
import sqlalchemy as sa
import tinker
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat, PublicFormat
from peft import PeftModel
from tinker import types
from transformers import AutoModelForCausalLM, AutoTokenizer

from api import download_urls
from db.models import Checkpoint
from storage import store

pytestmark = pytest.mark.slow  # trains, exports and loads models, on two servers (SQLite; Postgres on WebDAV)
TOKENS = list(range(10, 42))


def sft_datum(tokens: list[int]) -> types.Datum:
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": np.array(tokens[1:], dtype=np.int64),
                                       "weights": np.ones(len(tokens) - 1, dtype=np.float32)})


@pytest.fixture(scope="module")
def trained(service_client):
    """A run trained a few steps (its LoRA on every layer, the unembedding too: the default) and its
    forward logprobs of TOKENS, as the service computes them."""
    tc = service_client.create_lora_training_client(base_model="tiny", rank=8, seed=3).result()
    for _ in range(4):
        tc.forward_backward([sft_datum(TOKENS)], "cross_entropy")
        tc.optim_step(types.AdamParams(learning_rate=2e-2))
    logprobs = tc.forward([sft_datum(TOKENS)], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()
    return tc, logprobs


@pytest.fixture(scope="module")
def export(trained, server, api_key):
    tc, _ = trained
    saved = tc.save_weights_external("final").result()
    rest = tinker.RestClient(base_url=server.base_url, api_key=api_key)
    return saved, rest


def download(urls: dict[str, str], dest: Path) -> None:
    """As `tinker checkpoint download` does: a plain GET per file, no API key."""
    for name, url in urls.items():
        (dest / name).parent.mkdir(parents=True, exist_ok=True)
        with urllib.request.urlopen(url, timeout=60) as response:
            (dest / name).write_bytes(response.read())


def causal_logprobs(model, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([tokens[:-1]])).logits[0].float()
    return torch.log_softmax(logits, -1)[torch.arange(len(tokens) - 1), torch.tensor(tokens[1:])]


def test_export_is_a_checkpoint_of_type_external(trained, export):
    tc, _ = trained
    saved, rest = export
    assert saved.path == f"tinker://{tc.model_id}/external_weights/final"
    listed = {c.tinker_path: c for c in rest.list_checkpoints(tc.model_id).result().checkpoints}
    checkpoint = listed[saved.path]
    assert checkpoint.checkpoint_type == "external" and checkpoint.checkpoint_id == "external_weights/final"
    assert checkpoint.size_bytes > 0


def test_downloaded_export_loads_in_transformers_with_the_services_logprobs(trained, export, tiny_model_path, tmp_path):
    tc, service_logprobs = trained
    saved, rest = export
    response = rest.get_external_weights_urls(saved.path).result()
    assert datetime.now(UTC) + timedelta(minutes=50) < response.expires < datetime.now(UTC) + timedelta(hours=2)
    assert {"adapter_config.json", "adapter_model.safetensors", "merged/config.json", "merged/model.safetensors",
            "merged/tokenizer.json", "manifest.json"} <= set(response.urls)
    download(response.urls, tmp_path)
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    for name, entry in manifest["files"].items():  # every file arrived whole
        assert hashlib.sha256((tmp_path / name).read_bytes()).hexdigest() == entry["sha256"], name
    listed = {c.tinker_path: c for c in rest.list_checkpoints(tc.model_id).result().checkpoints}[saved.path]
    downloaded = sum(p.stat().st_size for p in tmp_path.rglob("*") if p.is_file())
    assert downloaded <= listed.size_bytes <= downloaded + 1024  # (a remote store counts its version pointer too)

    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    expected = torch.tensor(service_logprobs)
    assert causal_logprobs(merged, TOKENS) == pytest.approx(expected, abs=1e-4)
    # the adapter beside it, on the base model it names, gives the same numbers
    adapter_config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert adapter_config["base_model_name_or_path"] == "loraplex/tiny"
    with_adapter = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_path), tmp_path)
    assert causal_logprobs(with_adapter, TOKENS) == pytest.approx(expected, abs=1e-4)
    # trained: not the base model's numbers (its unembedding LoRA merged, and the embedding left as it was)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    assert (causal_logprobs(base, TOKENS) - expected).abs().max() > 1e-2
    assert torch.equal(merged.get_input_embeddings().weight, base.get_input_embeddings().weight)

    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "merged")
    assert tokenizer.encode("What is 1 + 2?") == tc.get_tokenizer().encode("What is 1 + 2?")


def with_query(url: str, **changes: str) -> str:
    parts = urlsplit(url)
    query = {k: v[0] for k, v in parse_qs(parts.query).items()} | changes
    return urlunsplit(parts._replace(query=urlencode(query)))


def status_of(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=60) as response:
            return response.status
    except urllib.error.HTTPError as e:
        return e.code


def test_a_tampered_or_expired_url_is_refused(export, server):
    saved, rest = export
    url = rest.get_external_weights_urls(saved.path).result().urls["merged/config.json"]
    assert status_of(url) == 200
    expires = int(parse_qs(urlsplit(url).query)["expires"][0])
    assert status_of(with_query(url, signature="0" * 64)) == 403
    assert status_of(with_query(url, expires=str(expires + 3600))) == 403  # a longer life than signed
    assert status_of(url.replace("merged/config.json", "merged/model.safetensors")) == 403  # another file
    # signed with the server's own key, but its time is up
    key = download_urls.signing_key(server.settings)
    past = int(datetime.now(UTC).timestamp()) - 1
    expired = download_urls.signed_url(server.base_url, key, saved.path, checkpoint_record(server, saved.path),
                                       "merged/config.json", past)
    assert status_of(expired) == 403
    # (the same signing, with the expiry the server gave, is the very URL it handed out)
    assert download_urls.signed_url(server.base_url, key, saved.path, checkpoint_record(server, saved.path),
                                    "merged/config.json", expires) == url


def checkpoint_record(server, tinker_path: str) -> str:
    with server.embedded.sessions() as s:
        return s.scalar(sa.select(Checkpoint.id).where(Checkpoint.tinker_path == tinker_path))


def test_only_the_owner_gets_urls_and_only_of_exports(trained, export, server, api_key):
    tc, _ = trained
    saved, rest = export
    stranger = tinker.RestClient(base_url=server.base_url, api_key=server.new_tenant())
    with pytest.raises(tinker.NotFoundError):
        stranger.get_external_weights_urls(saved.path).result()
    state = tc.save_state("state").result().path  # the SDK sends only external paths: ask over HTTP
    run_id, kind, name = state.removeprefix("tinker://").split("/")
    answer = httpx.get(f"{server.base_url}/api/v1/training_runs/{run_id}/checkpoints/{kind}/{name}/external_weights_urls",
                       headers={"X-API-Key": api_key})
    assert answer.status_code == 400 and "checkpoint_id" in answer.json()["detail"]


def test_an_export_encrypted_with_age_decrypts_to_the_same_model(trained, server, api_key, tmp_path):
    """Every file but the manifest is stored encrypted (`<file>.age`) to the recipients: here a native
    age key and an SSH key; either identity decrypts it."""
    tc, service_logprobs = trained
    identity = pyrage.x25519.Identity.generate()
    ssh_key = Ed25519PrivateKey.generate()
    ssh_public = ssh_key.public_key().public_bytes(Encoding.OpenSSH, PublicFormat.OpenSSH).decode()
    saved = tc.save_weights_external("sealed", age_encryption_recipients=[str(identity.to_public()), ssh_public]).result()
    rest = tinker.RestClient(base_url=server.base_url, api_key=api_key)
    urls = rest.get_external_weights_urls(saved.path).result().urls
    assert {name for name in urls if not name.endswith(".age")} == {"manifest.json"}
    assert {"merged/model.safetensors.age", "adapter_model.safetensors.age"} <= set(urls)
    download(urls, tmp_path)
    ssh_identity = pyrage.ssh.Identity.from_buffer(ssh_key.private_bytes(
        Encoding.PEM, PrivateFormat.OpenSSH, NoEncryption()))
    plain = tmp_path / "plain"
    for name in urls:
        if name.endswith(".age"):
            (plain / name).parent.mkdir(parents=True, exist_ok=True)
            sealed = (tmp_path / name).read_bytes()
            assert pyrage.decrypt(sealed, [ssh_identity]) == pyrage.decrypt(sealed, [identity])
            (plain / name.removesuffix(".age")).write_bytes(pyrage.decrypt(sealed, [identity]))
    merged = AutoModelForCausalLM.from_pretrained(plain / "merged")
    assert causal_logprobs(merged, TOKENS) == pytest.approx(torch.tensor(service_logprobs), abs=1e-4)
    with server.embedded.sessions() as s:  # no plain file reached the store
        location = s.scalar(sa.select(Checkpoint.storage_path).where(Checkpoint.tinker_path == saved.path))
    stored = [p.name for p in store.local_folder(location).rglob("*") if p.is_file()]
    assert len(stored) == len(urls) and all(name.endswith(".age") or name == "manifest.json" for name in stored)


def test_a_bad_age_recipient_is_refused_naming_it(trained):
    tc, _ = trained
    with pytest.raises(tinker.BadRequestError, match=r"age_encryption_recipients\[1\]: not an age recipient"):
        recipients = [str(pyrage.x25519.Identity.generate().to_public()), "age1qqqq"]
        tc.save_weights_external("sealed-badly", age_encryption_recipients=recipients).result()
    tc.forward([sft_datum(TOKENS)], "cross_entropy").result()  # the refusal released its seq_id


def test_a_deleted_export_is_gone_for_its_urls(trained, server, api_key):
    tc, _ = trained
    saved = tc.save_weights_external("temporary", ttl_seconds=3600).result()
    rest = tinker.RestClient(base_url=server.base_url, api_key=api_key)
    url = rest.get_external_weights_urls(saved.path).result().urls["adapter_config.json"]
    assert status_of(url) == 200
    rest.delete_checkpoint_from_tinker_path(saved.path).result()
    assert status_of(url) == 403
    assert saved.path not in {c.tinker_path for c in rest.list_checkpoints(tc.model_id).result().checkpoints}


def test_archive_of_an_export_is_its_peft_adapter(trained, export, server, api_key):
    """The archive route (older SDKs' download) and `loraplex-admin checkpoints export` give an export's adapter."""
    tc, _ = trained
    saved, _ = export
    answer = httpx.get(f"{server.base_url}/api/v1/training_runs/{tc.model_id}/checkpoints/external_weights/final/archive",
                       headers={"X-API-Key": api_key})
    assert answer.status_code == 200
    with tarfile.open(fileobj=io.BytesIO(answer.content)) as tar:
        assert sorted(tar.getnames()) == ["adapter", "adapter/adapter_config.json", "adapter/adapter_model.safetensors"]


def test_the_tinker_cli_downloads_an_export_and_a_training_state(trained, export, server, api_key, tmp_path):
    """`tinker checkpoint download`: an export's files as they are; a training state through a temporary
    export of its own (a new run loaded from it), which it deletes afterwards."""
    tc, service_logprobs = trained
    saved, rest = export
    state = tc.save_state("for-cli").result().path
    env = os.environ | {"TINKER_BASE_URL": server.base_url, "TINKER_API_KEY": api_key}
    for path in (saved.path, state):
        subprocess.run([Path(sys.executable).parent / "tinker", "checkpoint", "download", path, "--output", tmp_path],
                       env=env, check=True, timeout=300, capture_output=True)
        folder = tmp_path / path.removeprefix("tinker://").replace("/", "_")
        merged = AutoModelForCausalLM.from_pretrained(folder / "merged")
        assert causal_logprobs(merged, TOKENS) == pytest.approx(torch.tensor(service_logprobs), abs=1e-4), path
    exports = [c.tinker_path for c in rest.list_user_checkpoints().result().checkpoints
               if c.checkpoint_type == "external"]
    assert not [p for p in exports if p.endswith("/external_weights/download")]  # the temporary one is gone

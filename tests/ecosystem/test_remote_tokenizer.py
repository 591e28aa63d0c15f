"""A notebook on another machine gets the base model's tokenizer by hub id.

The client runs in a subprocess that shares nothing with the server but the network: its own
empty HOME, HF_HOME and working directory, HF_HUB_OFFLINE=1 (no hub here either). It talks to the
server through a TCP relay that keeps every byte the server sent, so the test can check what the
client received, whichever library received it.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest
import tinker
from huggingface_hub import scan_cache_dir
from transformers import AutoTokenizer

import loraplex
from service.embedded import ServerThread, free_port
from service.settings import Settings

CLIENT = Path(__file__).with_name("remote_client.py")
LORAPLEX_CLI = Path(sys.executable).with_name("loraplex")


class Relay:
    """127.0.0.1:<port> -> the server; `received` is every byte the server sent back."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.base_url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self._received = bytearray()
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def received(self) -> bytes:
        with self._lock:
            return bytes(self._received)

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:  # closed
                return
            upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
            threading.Thread(target=self._pump, args=(client, upstream, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, True), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket, record: bool) -> None:
        with contextlib.suppress(OSError):
            while data := source.recv(65536):
                if record:
                    with self._lock:
                        self._received += data
                sink.sendall(data)
        with contextlib.suppress(OSError):
            sink.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        self.listener.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    running = ServerThread(Settings(data_dir=tmp_path_factory.mktemp("server"), port=free_port(), base_model="tiny",
                                    sampler_enabled=False, long_poll_seconds=5))
    yield running
    running.stop()


@pytest.fixture(scope="module")
def smollm2_server(tmp_path_factory):
    running = ServerThread(Settings(data_dir=tmp_path_factory.mktemp("smollm2"), port=free_port(),
                                    base_model="SmolLM2-135M-Instruct", sampler_enabled=False, long_poll_seconds=5))
    yield running
    running.stop()


@pytest.fixture(scope="module")
def api_key(server):
    return server.new_tenant()


@pytest.fixture
def elsewhere(tmp_path) -> dict:
    """The environment of a client machine: nothing of this one's home, caches or repository."""
    home = tmp_path / "client-home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("HF_", "HUGGINGFACE_", "TRANSFORMERS_", "LORAPLEX_", "TINKER_", "PYTHON"))}
    return env | {"HOME": str(home), "HF_HOME": str(home / "hf"), "HF_HUB_OFFLINE": "1",
                  "LORAPLEX_MODEL_CACHE": str(home / "no-models")}


def run_client(env: dict, **args) -> dict:
    done = subprocess.run([sys.executable, str(CLIENT), json.dumps(args)], cwd=env["HOME"], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


def cached_bytes(hf_home: Path) -> bytes:
    return b"".join(p.read_bytes() for p in sorted(hf_home.rglob("*")) if p.is_file())


@pytest.mark.slow  # ~25 s: the client process imports tinker and transformers (~15 s on 2 cores)
@pytest.mark.parametrize("server_fixture, model, pull, hub_id", [
    ("server", "tiny", "cli", "loraplex/tiny"),
    ("smollm2_server", "SmolLM2-135M-Instruct", "sdk", "HuggingFaceTB/SmolLM2-135M-Instruct"),
])
def test_a_client_elsewhere_pulls_the_tokenizer_then_trains_with_the_official_sdk(request, server_fixture, model, pull,
                                                                                  hub_id, elsewhere):
    server = request.getfixturevalue(server_fixture)
    info = server.embedded.app.state.models.default.info
    relay = Relay(server.settings.port)
    try:
        seen = run_client(elsewhere, base_url=relay.base_url, api_key=server.new_tenant(), model=model, pull=pull)
    finally:
        relay.close()

    # named by the alias, answered with the hub id
    assert seen["get_info"]["model_data"] == {"arch": "llama", "model_name": hub_id, "tokenizer_id": hub_id}
    assert seen["capabilities"] == [hub_id]
    # before the pull the client could not load it: the checks below see the pull's effect, not a shared disk
    assert "couldn't find them in the cached files" in seen["error_before_pull"]
    assert "couldn't find them in the cached files" in seen["auto_error_before_pull"]
    assert hub_id in seen["pull_output"]

    # the same tokenizer as the server's own, by every loader
    own = AutoTokenizer.from_pretrained(info.path)
    assert seen["tokens"] == seen["sampler_tokens"] == seen["auto_tokens"] == own.encode("What is 2 + 3? 2 + 3 = 5")
    assert seen["chat"] == own.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert seen["sampler_base_model"] == hub_id
    assert seen["loss"] > 0

    hf_home = Path(elsewhere["HF_HOME"])
    (repo,) = scan_cache_dir(hf_home / "hub").repos
    assert repo.repo_id == hub_id and [r.refs for r in repo.revisions] == [frozenset({"main"})]

    # Nothing the client received names the server's model folder. The relay saw plain bytes (no
    # compressed answer hides a path) and did see the traffic (the hub id and the tokenizer).
    received = relay.received
    assert b"content-encoding" not in received.lower()
    assert hub_id.encode() in received and (info.path / "tokenizer.json").read_bytes() in received
    for folder in {str(info.path), str(info.path.resolve())}:
        assert folder.encode() not in received
        assert folder.encode() not in cached_bytes(hf_home)
        assert folder not in json.dumps(seen)


def test_a_second_pull_by_alias_reuses_the_cache(server, api_key, tmp_path):
    first = loraplex.pull_tokenizer(server.base_url, api_key, "tiny", hub_cache=tmp_path)
    again = loraplex.pull_tokenizer(server.base_url, api_key, "loraplex/tiny", hub_cache=tmp_path)
    assert first.model == again.model == "loraplex/tiny" and first.revision == again.revision
    assert sorted(first.downloaded) == sorted(again.reused) == ["chat_template.jinja", "config.json", "tokenizer.json",
                                                                "tokenizer_config.json"]
    assert again.downloaded == ()
    tokenizer = AutoTokenizer.from_pretrained("loraplex/tiny", cache_dir=tmp_path, local_files_only=True)
    assert tokenizer.encode("What is 1 + 2?") == AutoTokenizer.from_pretrained(
        server.embedded.app.state.models.default.info.path).encode("What is 1 + 2?")


def test_aliases_name_the_same_model_everywhere(server, api_key):
    headers = {"X-API-Key": api_key}
    listings = [httpx.get(f"{server.base_url}/api/v1/tokenizers/{name}/files", headers=headers).json()
                for name in ("tiny", "loraplex/tiny")]
    assert listings[0] == listings[1] and listings[0]["model"] == "loraplex/tiny"
    assert {f["path"] for f in listings[0]["files"]} == {"chat_template.jinja", "config.json", "tokenizer.json",
                                                        "tokenizer_config.json"}
    service = tinker.ServiceClient(base_url=server.base_url, api_key=api_key)
    for name in ("tiny", "loraplex/tiny"):
        training = service.create_lora_training_client(base_model=name, rank=4).result()
        assert training.get_info().model_data.model_name == "loraplex/tiny"
    with pytest.raises(tinker.BadRequestError, match="base_model: 'HuggingFaceTB/SmolLM2-135M-Instruct' is not "
                                                     "served here; served: 'loraplex/tiny' \\(also named 'tiny'\\)"):
        service.create_lora_training_client(base_model="HuggingFaceTB/SmolLM2-135M-Instruct", rank=4).result()


def test_an_unknown_model_is_a_404_naming_it(server, api_key, tmp_path):
    answer = httpx.get(f"{server.base_url}/api/v1/tokenizers/nobody/nothing/files", headers={"X-API-Key": api_key})
    assert answer.status_code == 404
    assert answer.json()["detail"] == ("model: no tokenizer for 'nobody/nothing': this server serves 'loraplex/tiny' "
                                       "(also named 'tiny')")
    with pytest.raises(loraplex.NotFoundError, match="'nobody/nothing'"):
        loraplex.pull_tokenizer(server.base_url, api_key, "nobody/nothing", hub_cache=tmp_path)
    done = subprocess.run([str(LORAPLEX_CLI), "tokenizer", "pull", "nobody/nothing", "--base-url", server.base_url,
                           "--api-key", api_key, "--cache-dir", str(tmp_path)], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 1 and "404: model: no tokenizer for 'nobody/nothing'" in done.stderr
    assert not any(tmp_path.iterdir())  # nothing cached


def test_only_the_listed_files_are_served_and_only_to_a_tenant(server, api_key):
    url = f"{server.base_url}/api/v1/tokenizers/loraplex/tiny/files"
    assert httpx.get(url).status_code == 401
    assert httpx.get(f"{url}/tokenizer.json", headers={"X-API-Key": "tml-not-a-key"}).status_code == 401
    weights = httpx.get(f"{url}/model.safetensors", headers={"X-API-Key": api_key})
    assert weights.status_code == 404 and weights.json()["detail"].startswith("filename: 'model.safetensors'")
    served = httpx.get(f"{url}/tokenizer.json", headers={"X-API-Key": api_key})
    assert served.content == (server.embedded.app.state.models.default.info.path / "tokenizer.json").read_bytes()


@pytest.mark.parametrize("path", ["x" * 5000 + "/files", "loraplex/tiny/files/..", "%00/files", "/files",
                                  "loraplex/tiny/files/%2e%2e%2fconfig.json",
                                  "loraplex/tiny/files/model.safetensors%00.json"])
def test_odd_names_are_refused_without_an_error_or_a_path(server, api_key, path):
    answer = httpx.get(f"{server.base_url}/api/v1/tokenizers/{path}", headers={"X-API-Key": api_key})
    assert answer.status_code == 404 and len(answer.text) < 1024
    assert str(server.embedded.app.state.models.default.info.path) not in answer.text

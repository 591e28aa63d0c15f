"""The README's quick start, pasted as it is: its ```python block, with only the base URL and the
API key filled in, runs against `python -m service serve` (the README's command) in a fresh
interpreter, as a notebook on the server's machine would.

Both processes get a user's environment: none of the HF_*, TRANSFORMERS_*, TINKER_* or LORAPLEX_*
variables the test run sets (no HF_HUB_OFFLINE), and an HF_HOME that is an empty folder when the
server starts, so nothing here was prepared by hand: the tokenizer the block loads is the one the
server put in that cache. The block's first line sets HF_HUB_OFFLINE itself, and it runs twice:
with no hub (this network reaches none; without that line transformers retries the hub for 2
minutes before it falls back to the cache) and with a hub that answers but has never heard of
`loraplex/tiny`, as huggingface.co answers for a repo it lacks (without that line transformers
raises RepositoryNotFoundError there, cache or not); that hub checks that no request reaches it.
"""

from __future__ import annotations

import http.server
import os
import re
import subprocess
import sys
import threading
import time

import pytest

from service.embedded import free_port
from tests.distributed.processes import ROOT, start_service, wait_healthy
from tests.reliability.processes import stop, tenant_key

pytestmark = pytest.mark.vllm  # the server runs the vLLM sampler: the block samples

README = ROOT / "README.md"
URL, KEY = '"http://127.0.0.1:8000"', '"tml-..."'  # what the block says; the only things replaced
# A retry storm costs 23 s per hub request (5 retries, 1+2+4+8+8 s), 125 s for this block; the
# block takes 5-11 s on 2 cores (the first run waits for the sampler's vLLM to finish loading).
BOUND_SECONDS = 90


def readme_block() -> str:
    blocks = re.findall(r"^```python\n(.*?)^```", README.read_text(), re.MULTILINE | re.DOTALL)
    assert len(blocks) == 1, "the README has one ```python block, the quick start"
    (block,) = blocks
    assert block.count(URL) == 1 and block.count(KEY) == 1, f"the block names {URL} and {KEY} once each"
    return block


def users_environment(hf_home) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("HF_", "HUGGINGFACE_", "TRANSFORMERS_", "TINKER_", "LORAPLEX_", "PYTHON"))}
    return env | {"HF_HOME": str(hf_home)}


class Hub:
    """127.0.0.1:<port> answering every request as huggingface.co answers an anonymous one for a
    repo it does not have (401, X-Error-Code RepoNotFound); `requests` is what reached it."""

    def __init__(self) -> None:
        self.requests: list[str] = []
        hub = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_HEAD(self) -> None:
                hub.requests.append(f"{self.command} {self.path}")
                body = b'{"error":"Repository not found"}'
                self.send_response(401)
                self.send_header("X-Error-Code", "RepoNotFound")
                self.send_header("X-Error-Message", "Repository not found")
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            do_GET = do_POST = do_HEAD

            def log_message(self, *args) -> None:
                pass

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """`python -m service serve` on its defaults (the tiny model, the sampler), with a user's
    environment and an empty HF_HOME: (base URL, a tenant's key, that environment)."""
    hf_home = tmp_path_factory.mktemp("hf-home")
    env = users_environment(hf_home)
    data_dir = tmp_path_factory.mktemp("serve")
    port = free_port()
    # a small KV cache (the default takes 1 GiB of this machine's memory); nothing else is set
    process = start_service("serve", env | {"LORAPLEX_SAMPLER_KV_CACHE_GIB": "0.25"}, "--port", str(port),
                            "--data-dir", str(data_dir))
    try:
        wait_healthy(process, f"http://127.0.0.1:{port}", seconds=300)
        yield f"http://127.0.0.1:{port}", tenant_key(data_dir, "notebook"), env
    finally:
        stop(process)


@pytest.mark.parametrize("hub", ["none", "without the model"])
def test_the_readme_quick_start_runs_as_pasted(served, hub, tmp_path):
    base_url, api_key, env = served
    code = readme_block().replace(URL, repr(base_url)).replace(KEY, repr(api_key))
    notebook = tmp_path / "quickstart.py"
    notebook.write_text(code)
    answering = Hub() if hub == "without the model" else None
    if answering is not None:
        env = env | {"HF_ENDPOINT": answering.url}
    try:
        started = time.monotonic()
        done = subprocess.run([sys.executable, str(notebook)], check=False, cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=300)
        seconds = time.monotonic() - started
    finally:
        if answering is not None:
            answering.close()
    report = (f"exit {done.returncode} after {seconds:.0f} s\nstdout:\n{done.stdout[-2000:]}\n"
              f"stderr:\n{done.stderr[-4000:]}")
    assert done.returncode == 0, report
    assert "Retrying" not in done.stderr and "Could not reach the Hub" not in done.stderr, report
    assert not re.search(r"warn", done.stderr, re.IGNORECASE), report  # a FutureWarning: a future used as a client
    metrics, samples = done.stdout.strip().splitlines()
    assert "'loss:sum'" in metrics and samples.startswith("SampleResponse(") and samples.count("SampledSequence(") == 4
    assert seconds < BOUND_SECONDS, report
    if answering is not None:
        assert answering.requests == []

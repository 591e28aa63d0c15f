"""Shared fixtures: base models are built once per machine into the registry cache; a module
that defines a `server` fixture (an embedded ServerThread), or whose package's conftest does, gets
`api_key` and `service_client`;
`webdav_store` makes locations on a real WebDAV server, the remote checkpoint store of the tests."""

import os
import re
import subprocess
import sys
import uuid

import pytest
import tinker
import torch

# Without a GPU, Triton kernels can only run under its interpreter, which must be switched on
# before anything imports triton (peft and transformers may): hence here, before every test module.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# No machine here reaches the hub: without this, a tokenizer lookup by hub id retries it five
# times per file (53 s for one miss) before it falls back to the local cache.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# pytest-xdist starts its workers with COLUMNS=80, and Rich fixes a console's width from COLUMNS when
# the console is made (admin/common.py's, at import): the admin tests' own COLUMNS would be ignored.
os.environ.pop("COLUMNS", None)

from models.registry import resolve_model
from tests.waiting import wait_until

WEBDAV_SERVER = "import sys; from wsgidav.server.server_cli import run; sys.argv[0] = 'wsgidav'; sys.exit(run())"


@pytest.fixture(scope="session")
def tiny_model_path():
    return resolve_model("tiny")


@pytest.fixture(scope="module")
def api_key(server):
    """A new tenant's key on this module's `server`."""
    return server.new_tenant()


@pytest.fixture(scope="module")
def service_client(server, api_key):
    return tinker.ServiceClient(base_url=server.base_url, api_key=api_key)


@pytest.fixture(scope="session")
def webdav_store(tmp_path_factory):
    """A function returning a fresh `webdav://` store location on a WsgiDAV server on loopback.
    The server's address reaches fsspec here and in child processes through FSSPEC_WEBDAV_BASE_URL."""
    import fsspec
    import httpx

    from service.embedded import free_port

    port = free_port()
    root = tmp_path_factory.mktemp("webdav")
    server = subprocess.Popen([sys.executable, "-c", WEBDAV_SERVER, "--host", "127.0.0.1", "--port", str(port),
                               "--root", str(root), "--auth", "anonymous", "-q"])
    base_url = f"http://127.0.0.1:{port}"

    def answers() -> bool:
        assert server.poll() is None, "the WebDAV server exited"
        try:
            httpx.request("PROPFIND", base_url, headers={"Depth": "0"}, timeout=1)
            return True
        except httpx.TransportError:
            return False

    wait_until(answers, "the WebDAV server to answer", timeout=60, interval=0.1)
    os.environ["FSSPEC_WEBDAV_BASE_URL"] = base_url
    fsspec.config.conf.setdefault("webdav", {})["base_url"] = base_url
    yield lambda: f"webdav://loraplex-{uuid.uuid4().hex[:8]}"
    server.terminate()
    server.wait(timeout=10)


FAST = "not slow and not vllm and not distributed and not gpu"
LEFT_OUT_MODULE = re.compile(r"^pytestmark = .*\bpytest\.mark\.(slow|vllm|distributed|gpu)\b", re.MULTILINE)


def pytest_addoption(parser):
    parser.addoption("--fast", action="store_true", help=f"only the tests a developer runs in a minute: -m '{FAST}'")


def pytest_configure(config):
    if config.getoption("--fast"):
        config.option.markexpr = f"({config.option.markexpr}) and {FAST}" if config.option.markexpr else FAST


def pytest_ignore_collect(collection_path, config):
    """Under --fast, a test module left out whole (a `pytestmark` of a left-out marker, or under
    tests/distributed/) is not even imported: the imports of some (vLLM, schemathesis) take seconds."""
    if not config.getoption("--fast") or collection_path.suffix != ".py":
        return None
    if collection_path.is_relative_to(config.rootpath / "tests" / "distributed"):
        return True
    if collection_path.name.startswith("test_") and LEFT_OUT_MODULE.search(collection_path.read_text()):
        return True
    return None


@pytest.hookimpl(tryfirst=True)  # before -m selects by marker
def pytest_collection_modifyitems(config, items):
    """Everything under tests/distributed/ starts PostgreSQL-, Redis- or Celery-backed processes."""
    distributed = config.rootpath / "tests" / "distributed"
    for item in items:
        if item.path.is_relative_to(distributed):
            item.add_marker(pytest.mark.distributed)


# The pytest process ends without the interpreter's teardown. One clean-clone CI run (2026-12-02)
# printed "319 passed" and then died of SIGABRT during teardown, with no message; the test process
# by then holds many finished servers' native threads (vLLM, gloo, OpenMP, the tinker SDK's
# heartbeats). A server process itself exited with 0 after SIGINT in 4 of 4 tries. The exit
# status is the session's, so a failed test still fails the run.
_exit_status = 0


def pytest_sessionfinish(session, exitstatus):
    global _exit_status
    _exit_status = int(exitstatus)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(_exit_status)

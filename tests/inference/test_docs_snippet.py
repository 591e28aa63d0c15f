"""docs/inference-proxy.md's first ```python block, as written (only the base URL and the key filled in),
runs in a fresh interpreter against the package's server: an agent call through the OpenAI SDK, its
trajectory turned into datums and trained by the official tinker SDK and by loraplex's own."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests.distributed.processes import ROOT

pytestmark = pytest.mark.vllm  # the package's server runs the vLLM sampler

DOC = ROOT / "docs" / "inference-proxy.md"
URL, KEY = '"http://127.0.0.1:8000"', '"tml-..."'


def test_the_rollouts_to_datums_snippet_runs_with_both_sdks(server, api_key):
    block = re.search(r"^```python\n(.*?)^```", DOC.read_text(), re.MULTILINE | re.DOTALL).group(1)
    assert block.count(URL) == 1 and block.count(KEY) == 1
    code = block.replace(URL, f'"{server.base_url}"').replace(KEY, f'"{api_key}"')
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    printed = done.stdout.strip().splitlines()
    assert len(printed) == 2 and all("loss:sum" in line for line in printed), done.stdout

"""The SDK's wire code runs on protobuf 6 and 7 alike, so installing it never downgrades a notebook's protobuf.

The SDK asks for `protobuf>=6.33.5,<8` (client_sdk/pyproject.toml): its generated tinker_public_pb2.py
is gencode 6.33.5, which a 6.x runtime from 6.33.5 on and any 7.x runtime load. Each runtime is
installed into a folder of its own that shadows the server's, and a fresh interpreter, with every
warning an error, loads the wire code, checks the descriptor against the official SDK's and
round-trips a sample response and a forward_backward output through the official SDK's decoders.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROBE = """
import google.protobuf, numpy as np
from loraplex.wire import codec, tinker_public_pb2 as pb
from tinker.proto import response_conv, tinker_public_pb2 as sdk_pb
assert pb.DESCRIPTOR.serialized_pb == sdk_pb.DESCRIPTOR.serialized_pb
seq = codec.SampledSequenceWire(tokens=[5, 6, 7], logprobs=[-0.5, -1.0, -1.5], stop_reason="length")
sample = response_conv.deserialize_sample_response(codec.encode_sample_response([seq], [None, -2.0]))
assert list(sample.sequences[0].tokens) == [5, 6, 7] and sample.prompt_logprobs == [None, -2.0]
output = codec.encode_forward_backward_output([{"logprobs": np.array([-0.25, -0.75], np.float32)}], {"loss:sum": 1.5})
fwd = response_conv.deserialize_forward_backward_output(output)
assert fwd.metrics == {"loss:sum": 1.5} and fwd.loss_fn_outputs[0]["logprobs"].tolist() == [-0.25, -0.75]
print(google.protobuf.__version__)
"""


@pytest.mark.slow  # a pip install and a fresh interpreter per runtime
@pytest.mark.parametrize("version", ["6.33.6", "7.36.2"])
def test_the_wire_code_runs_on_each_protobuf_major(version, tmp_path):
    runtime = tmp_path / "protobuf"
    install = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                              "--no-deps", "--target", str(runtime), f"protobuf=={version}"],
                             capture_output=True, text=True, timeout=600)
    assert install.returncode == 0, install.stderr
    probe = subprocess.run([sys.executable, "-W", "error", "-c", PROBE], cwd=ROOT, capture_output=True, text=True,
                           timeout=300, env={"PYTHONPATH": str(runtime), "PATH": "/usr/bin:/bin"})
    assert probe.returncode == 0, probe.stderr
    assert probe.stdout.split() == [version]  # the runtime under test, not the server's

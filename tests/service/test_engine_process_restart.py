"""The embedded server's engine child process dies: the cycle fails clearly, a new child starts,
and the model continues with exactly the acknowledged history (gradients replayed)."""

from __future__ import annotations

import numpy as np
import pytest
from tinker import types

from tests.servers import running_server
from tests.uninterrupted import logprobs_after_steps

pytestmark = pytest.mark.slow  # an engine child process killed and replaced
TOKENS = list(range(10, 30))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with running_server(tmp_path_factory.mktemp("loraplex"), engine_process=True, sampler_enabled=False) as running:
        yield running


def datum() -> types.Datum:
    return types.Datum(model_input=types.ModelInput.from_ints(TOKENS[:-1]),
                       loss_fn_inputs={"target_tokens": np.array(TOKENS[1:]), "weights": np.ones(len(TOKENS) - 1, np.float32)})


def test_a_dead_engine_process_is_replaced_and_nothing_acknowledged_is_lost(server, service_client, tiny_model_path):
    tc = service_client.create_lora_training_client(base_model="tiny", rank=4, seed=2).result()
    tc.forward_backward([datum()], "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    tc.forward_backward([datum()], "cross_entropy").result()  # its gradient lives in the child only

    executor = server.embedded.executor
    old_pid = executor._proc.pid
    executor._proc.kill()
    executor._proc.join()
    with pytest.raises(Exception, match="engine process died"):
        tc.forward([datum()], "cross_entropy").result()
    assert executor._proc.pid != old_pid and executor._proc.is_alive()

    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()  # uses the replayed gradient
    after = tc.forward([datum()], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()
    expected = logprobs_after_steps(tiny_model_path, TOKENS, rank=4, seed=2, steps=2, lr=1e-2)
    assert after == pytest.approx(expected, rel=1e-5)

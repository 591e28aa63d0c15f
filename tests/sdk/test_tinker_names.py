"""The loraplex SDK where the official tinker SDK has a future or another name: the same names
and shapes against a real server, and retries that say at once what they wait for."""

from __future__ import annotations

import logging
import time

import loraplex
import numpy as np
import pytest
from loraplex import types

from service.embedded import free_port
from tests.servers import running_server

TOKENS = list(range(10, 30))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with running_server(tmp_path_factory.mktemp("names"), sampler_enabled=False) as running:
        yield running


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def test_a_wrong_port_is_said_at_once_and_once():
    records = Records()
    logging.getLogger("loraplex").addHandler(records)
    url = f"http://127.0.0.1:{free_port()}"
    started = time.time()
    try:
        with pytest.raises(loraplex.APIConnectionError):
            loraplex.ServiceClient(base_url=url, api_key="tml-x", retry_seconds=2)
    finally:
        logging.getLogger("loraplex").removeHandler(records)
    [told] = records.records  # several retries, one line
    assert told.created - started < 2.0, "the first retry was not told at once"
    message = told.getMessage()
    assert f"POST {url}/api/v1/create_session failed" in message and "connect" in message.lower(), message
    assert "retrying for up to 2 s" in message


def rest_sampler(service, sampler) -> str:
    """The snapshot the server says a sampler samples (this server runs no vLLM: nothing is sampled)."""
    return service.create_rest_client().get_sampler(sampler.sampler_id)["model_path"]


def test_tinker_names_and_futures(server):
    key = server.new_tenant("names")
    with loraplex.ServiceClient(base_url=server.base_url, api_key=key) as service:
        training = service.create_lora_training_client("tiny", rank=4, seed=0)
        datum = types.Datum(model_input=types.ModelInput.from_ints(TOKENS[:-1]), loss_fn_inputs={
            "target_tokens": np.array(TOKENS[1:]), "weights": np.ones(len(TOKENS) - 1, np.float32)})
        training.forward_backward([datum], "cross_entropy").result()
        training.optim_step(types.AdamParams(learning_rate=1e-3)).result()
        path = training.save_weights_for_sampler("named").result().path
        sampler = training.create_sampling_client(path)  # a sampling session of the snapshot, on the server
        assert rest_sampler(service, sampler) == path

        rest = service.create_rest_client()
        runs = rest.list_training_runs().result()
        assert [r.training_run_id for r in runs.training_runs] == [training.model_id]
        assert runs.cursor["total_count"] == 1
        assert [c.tinker_path for c in rest.list_user_checkpoints().result().checkpoints] == [path]
        rest.publish_checkpoint_from_tinker_path(path).result()
        assert [c.public for c in rest.list_checkpoints(training.model_id)] == [True]
        rest.unpublish_checkpoint_from_tinker_path(path).result()
        assert [c.public for c in rest.list_checkpoints(training.model_id)] == [False]

"""Through a real embedded server on `tiny`: a model whose newest stored training state is damaged
(bytes flipped, truncated, deleted) while the server is down, or while the model is evicted from
a running server, is rebuilt from the previous stored state and a replay of the requests after
it, and goes on with the numbers of a run that was never interrupted."""

from __future__ import annotations

from pathlib import Path

import pytest
import tinker
from tinker import types

from storage.live_slots import read_slots
from tests.workers.trainer.test_live_state_integrity import corrupt
from tests.servers import running_server
from tests.service.test_scheduling import assert_same_as_uninterrupted, http_client, sft_data, wait_result

pytestmark = pytest.mark.slow  # servers restarted on damaged states
SETTINGS = dict(sampler_enabled=False, state_write_interval_seconds=0, cycle_gather_seconds=0)


def train(server) -> tuple[str, tinker.TrainingClient]:
    """A tenant's model (rank 4, seed 5): create (seq_id 0), two rounds of forward_backward(sft_data(seed))
    + optim_step (1-4), and forward_backward(sft_data(2)) (5), whose gradient no optim_step has applied."""
    key = server.new_tenant()
    tc = tinker.ServiceClient(base_url=server.base_url, api_key=key).create_lora_training_client(
        base_model="tiny", rank=4, seed=5).result()
    for seed in (0, 1):
        tc.forward_backward(sft_data(seed), "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=0.01)).result()
    tc.forward_backward(sft_data(2), "cross_entropy").result()
    return key, tc


def stored(data_dir: Path, model_id: str) -> list[tuple[int, Path]]:
    return [(s.seq, Path(s.path)) for s in read_slots(data_dir / "live", model_id) if s.manifest]


@pytest.mark.parametrize("how, engine_process", [("flip", False), ("truncate", False), ("delete", False),
                                                 ("delete folder", False), ("flip", True)])
def test_a_damaged_newest_state_is_rebuilt_from_the_previous_one_across_a_restart(tmp_path, how, engine_process):
    with running_server(tmp_path, engine_process=engine_process, **SETTINGS) as first:
        key, tc = train(first)
    (newest, newest_path), (previous, _) = stored(tmp_path, tc.model_id)
    assert newest == 5  # the last forward_backward's state, its gradient in it
    # the step's before (4), or the one before that where the writer still held 4 when 5 came and wrote 5
    # in its place (a newer state replaces one waiting: workers/trainer/state_writer.py)
    assert previous in (3, 4)
    corrupt(newest_path, how)  # so the gradient of 5 is lost with it: requests after `previous` are replayed

    with running_server(tmp_path, engine_process=engine_process, **SETTINGS) as second:
        with http_client(second, key) as http:  # the pending gradient of seq_id 5 must be there again
            step = http.post("/api/v1/optim_step", json={"model_id": tc.model_id, "seq_id": 6,
                                                         "adam_params": {"learning_rate": 0.01}})
            assert "metrics" in wait_result(http, step.json()["request_id"]).json()
        assert_same_as_uninterrupted(second, key, tc.model_id, 7, seeds=[0, 1, 2])
        assert all(seq >= 6 for seq, path in stored(tmp_path, tc.model_id)[:1])  # written again since


def test_a_damaged_lone_copy_of_a_paged_out_model_is_made_again_from_the_journal(tmp_path):
    """A run paged out keeps one verified copy (docs/memory.md). Damaged while it is out, it is made again
    from its create_model (seeded: the same adapter) and the requests after it, which the database keeps;
    the request that found the damage fails, saying so, and the next one runs on the rebuilt state."""
    with running_server(tmp_path, max_resident_adapters=1, **SETTINGS) as server:
        key, tc = train(server)
        other = tinker.ServiceClient(base_url=server.base_url, api_key=key).create_lora_training_client(
            base_model="tiny", rank=4, seed=6).result()
        other.forward_backward(sft_data(3), "cross_entropy").result()  # room for one: the first model goes out
        [(newest, newest_path)] = stored(tmp_path, tc.model_id)
        assert newest == 5  # paged out as of seq_id 5, its pending gradient included: one copy
        corrupt(newest_path, "flip")
        with pytest.raises(tinker.RequestFailedError, match="must be replayed onto it first; send the request again"):
            tc.optim_step(types.AdamParams(learning_rate=0.01)).result()
        tc.optim_step(types.AdamParams(learning_rate=0.01)).result()  # needs the gradient of 5: replayed
        assert_same_as_uninterrupted(server, key, tc.model_id, 8, seeds=[0, 1, 2])

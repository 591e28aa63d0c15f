"""A model with no usable stored training state (both copies damaged): its requests fail with a
clear server error naming what was found and the repair, and `loraplex-admin models rebuild`
(from its create_model, or from a checkpoint it saved, plus a replay of the requests after it)
or `models reset` (to a named checkpoint) makes it train on with the expected numbers."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from admin.cli import app
from storage.live_slots import read_slots
from tests.workers.trainer.test_live_state_integrity import corrupt
from tests.scheduler.test_live_state_recovery import SETTINGS, train
from tests.servers import running_server
from tests.service.test_scheduling import (
    PROTOBUF,
    assert_same_as_uninterrupted,
    http_client,
    proto_body,
    sft_data,
    wait_result,
)

pytestmark = pytest.mark.slow  # servers restarted to repair damaged models


def admin(data_dir: Path, *args: str, ok: bool = True) -> str:
    result = CliRunner().invoke(app, list(args), env={"LORAPLEX_DATA_DIR": str(data_dir), "COLUMNS": "1000"})
    assert (result.exit_code == 0) == ok, result.output
    return result.output


def damage_both(data_dir: Path, model_id: str) -> None:
    for slot in read_slots(data_dir / "live", model_id):
        corrupt(Path(slot.path), "truncate")


def post(server, key: str, route: str, seq_id: int, model_id: str, **body):
    """A request with an explicit seq_id; its stored answer (JSON)."""
    with http_client(server, key) as http:
        r = http.post(f"/api/v1/{route}", json={"model_id": model_id, "seq_id": seq_id, **body})
        return wait_result(http, r.json()["request_id"]).json()


def step(server, key: str, model_id: str, seq_id: int) -> dict:
    return post(server, key, "optim_step", seq_id, model_id, adam_params={"learning_rate": 0.01})


def test_a_rebuild_from_create_model_repairs_a_model_with_no_usable_state(tmp_path):
    """With the server down. (A running server makes such a model again from its create_model by
    itself: tests/scheduler/test_live_state_recovery.py; what cannot be made again fails, saying what to
    do: tests/workers/trainer/test_live_state_integrity.py.)"""
    with running_server(tmp_path, **SETTINGS) as first:
        key, tc = train(first)  # create 0, fb 1, step 2, fb 3, step 4, fb 5
    damage_both(tmp_path, tc.model_id)

    state = admin(tmp_path, "models", "state", tc.model_id)
    slots, usable = state.split("bases a rebuild could start from")
    assert slots.count("failed its integrity check") == 2
    rows = [[cell.strip() for cell in line.split("│")[1:4]] for line in usable.splitlines() if "│" in line]
    assert ["its create_model (seq_id 0)", "0", "yes"] in rows
    out = admin(tmp_path, "models", "rebuild", tc.model_id)
    assert "rebuilding from its create_model (seq_id 0)" in out and "rebuilt (5 requests replayed)" in out

    with running_server(tmp_path, **SETTINGS) as second:
        assert "metrics" in step(second, key, tc.model_id, 6)  # the gradient of seq_id 5 is back
        assert_same_as_uninterrupted(second, key, tc.model_id, 7, seeds=[0, 1, 2])


def test_a_rebuild_starts_from_the_latest_checkpoint_the_model_saved(tmp_path):
    with running_server(tmp_path, **SETTINGS) as first:
        key, tc = train(first)
        saved = post(first, key, "save_weights", 6, tc.model_id, path="mid")["path"]  # the state after step 4
    damage_both(tmp_path, tc.model_id)
    out = admin(tmp_path, "models", "rebuild", tc.model_id)  # with the server down
    assert f"rebuilding from checkpoint {saved} (saved at seq_id 6), replaying its requests after seq_id 4" in out
    assert "rebuilt (1 request replayed)" in out  # the forward_backward of seq_id 5

    with running_server(tmp_path, **SETTINGS) as second:
        assert "metrics" in step(second, key, tc.model_id, 7)
        assert_same_as_uninterrupted(second, key, tc.model_id, 8, seeds=[0, 1, 2])


def test_reset_makes_a_named_checkpoint_the_models_state(tmp_path):
    with running_server(tmp_path, **SETTINGS) as server:
        key, tc = train(server)
        early = post(server, key, "save_weights", 6, tc.model_id, path="early")["path"]
        # a running server would write over the reset with its next step: refused while it runs
        assert "not reset: a Loraplex scheduler is running" in admin(
            tmp_path, "models", "reset", tc.model_id, early, "--yes", ok=False)

    admin(tmp_path, "models", "reset", tc.model_id, "tinker://nope/weights/x", "--yes", ok=False)
    out = admin(tmp_path, "models", "reset", tc.model_id, early, "--yes")
    assert f"its stored state is now {early}" in out
    with running_server(tmp_path, **SETTINGS) as server:
        # from the checkpoint (two rounds: seeds 0 and 1), without the pending gradient of seq_id 5
        with http_client(server, key) as http:
            r = http.post("/api/v1/forward_backward", content=proto_body(tc.model_id, 7, sft_data(3)), headers=PROTOBUF)
            assert wait_result(http, r.json()["request_id"]).status_code == 200
        assert "metrics" in step(server, key, tc.model_id, 8)
        assert_same_as_uninterrupted(server, key, tc.model_id, 9, seeds=[0, 1, 3])

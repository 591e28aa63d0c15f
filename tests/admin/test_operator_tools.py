"""`loraplex-admin` tells the operator the truth: whole ids and paths (a terminal, a pipe, or --json
on every list), keys labelled, prefixes that name one key, byte sizes for people, no progress bars,
rebuild messages that agree, and a reset refused while a server would write over it."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import tinker
from tinker import types

from admin.output import human_bytes
from tests.admin.cli import admin_cli, printed_key
from tests.scheduler.test_live_state_recovery import SETTINGS, train
from tests.servers import running_server
from tests.service.test_scheduling import sft_data

pytestmark = pytest.mark.slow  # servers with the tiny model, and the CLI run as its own process
ADMIN = str(Path(sys.executable).with_name("loraplex-admin"))
LISTS = [("tenants", "list"), ("keys", "list"), ("checkpoints", "list"), ("operator-keys", "list"), ("usage",)]


def piped(data_dir: Path, *args: str, ok: bool = True) -> str:
    """The CLI as an operator pipes it: its own process, 80 columns, stdout not a terminal."""
    env = os.environ | {"LORAPLEX_DATA_DIR": str(data_dir), "COLUMNS": "80"}
    done = subprocess.run([ADMIN, *args], env=env, capture_output=True, text=True, timeout=300, check=False)
    assert (done.returncode == 0) == ok, done.stdout + done.stderr
    return done.stdout + done.stderr


def test_byte_sizes_read_as_sizes():
    assert [human_bytes(n) for n in (0, 1023, 1536, 5 * 2**20, 3 * 2**40)] == \
        ["0 B", "1023 B", "1.5 KiB", "5.0 MiB", "3.0 TiB"]


def test_keys_are_labelled_listed_and_named_by_one_prefix(tmp_path):
    admin = admin_cli(tmp_path)
    admin("tenants", "create", "ivy")
    issued = admin("keys", "issue", "ivy")
    key = printed_key(issued)
    assert "new API key of tenant 'ivy' (shown once" in issued
    admin("keys", "revoke", key[:12])
    keys = json.loads(admin("keys", "list", "ivy", "--json"))
    assert [k["state"] for k in keys] == ["active", "revoked"] and keys[1]["revoked"] is not None
    assert re.search(r"tml-\S+\.\.\. .*revoked", admin("keys", "list", "ivy"))

    first, second = (re.findall(r"tmo-[A-Za-z0-9_-]{43}", admin("operator-keys", "issue"))[-1] for _ in range(2))
    refused = admin("operator-keys", "revoke", "tmo-", ok=False)
    assert "2 live operator keys match 'tmo-'" in refused
    assert [k["state"] for k in json.loads(admin("operator-keys", "list", "--json"))] == ["active", "active"]
    admin("operator-keys", "revoke", first[:12])
    listed = json.loads(admin("operator-keys", "list", "--json"))
    assert [(k["key"], k["state"]) for k in listed] == [(first[:12] + "...", "revoked"), (second[:12] + "...", "active")]
    for command in LISTS:
        assert isinstance(json.loads(admin(*command, "--json")), list), command


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A stopped server's data dir with a model and its checkpoints (long names: longer than 80 columns)."""
    data_dir = tmp_path_factory.mktemp("tools")
    with running_server(data_dir, **SETTINGS) as server:
        key = server.new_tenant("june")
        tc = tinker.ServiceClient(base_url=server.base_url, api_key=key).create_lora_training_client(
            base_model="tiny", rank=4, seed=1).result()
        tc.forward_backward(sft_data(0), "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=0.01)).result()
        paths = [tc.save_state("state-with-a-rather-long-name").result().path,
                 tc.save_weights_for_sampler("sampler-with-a-rather-long-name").result().path]
    return data_dir, tc.model_id, paths


def test_checkpoint_paths_are_whole_when_piped(trained):
    data_dir, _, paths = trained
    listing = piped(data_dir, "checkpoints", "list")
    assert all(len(p) > 70 and p in listing for p in paths), listing
    rows = json.loads(piped(data_dir, "checkpoints", "list", "--json"))
    assert sorted(r["path"] for r in rows) == sorted(paths) and all(r["size_bytes"] > 0 for r in rows)
    assert re.search(r"\d+\.\d (KiB|MiB)", listing)


def test_rebuild_says_what_it_replays_and_no_progress_bars_show(trained):
    data_dir, model_id, _ = trained
    out = piped(data_dir, "models", "rebuild", model_id)
    planned = re.search(r"replaying its requests after seq_id \d+: (\d+) forward_backward", out)
    replayed = int(re.search(r"rebuilt \((\d+) requests? replayed\)", out).group(1))
    assert (int(planned.group(1)) if planned else 0) == replayed, out
    assert planned or "nothing to replay" in out, out
    assert "%|" not in out and "it/s" not in out, out  # tqdm's bars (the base model loading)


def test_reset_is_refused_while_a_server_runs(tmp_path):
    with running_server(tmp_path, **SETTINGS) as server:
        _, tc = train(server)
        early = tc.save_state("early").result().path
        refused = admin_cli(tmp_path)("models", "reset", tc.model_id, early, "--yes", ok=False)
        assert f"{tc.model_id}: not reset: a Loraplex scheduler is running on this database" in refused
        assert "Stop the server" in refused
        # nothing changed: the model trains on from where it was
        tc.optim_step(types.AdamParams(learning_rate=0.01)).result()
    out = admin_cli(tmp_path)("models", "reset", tc.model_id, early, "--yes")  # stopped: its row is gone
    assert f"its stored state is now {early}" in out

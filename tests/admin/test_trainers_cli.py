"""Operators see the trainer's memory: `loraplex-admin trainers` and the operator dashboard read what a
running server's trainer holds resident and has paged out, as its scheduler's beat stored it."""

from __future__ import annotations

import json

import httpx
import numpy as np
import pytest
import tinker
from tinker import types

from db.operator_keys import issue_operator_key
from tests.admin.cli import admin_cli
from tests.servers import running_server
from tests.waiting import wait_until

pytestmark = pytest.mark.slow  # a server trains three runs and waits for its scheduler's beats
TOKENS = list(range(10, 30))


def test_the_trainers_memory_is_shown_to_operators(tmp_path):
    with running_server(tmp_path, sampler_enabled=False, trainer_memory_budget=1) as server:
        admin = admin_cli(tmp_path)
        assert "no service is running" not in admin("trainers")
        client = tinker.ServiceClient(base_url=server.base_url, api_key=server.new_tenant())
        datum = types.Datum(model_input=types.ModelInput.from_ints(TOKENS[:-1]),
                            loss_fn_inputs={"target_tokens": np.array(TOKENS[1:]), "weights": np.ones(len(TOKENS) - 1)})
        # a budget of 1 byte is under any run: the runs are created before it applies, each then runs
        # alone and is paged out by the next
        server.embedded.executor.residency.budget_bytes = 0
        runs = [client.create_lora_training_client(base_model="tiny", rank=4).result() for _ in range(3)]
        server.embedded.executor.residency.budget_bytes = 1
        for run in runs:
            run.forward_backward([datum], "cross_entropy").result()
        runs[0].forward_backward([datum], "cross_entropy").result()  # paged back in

        def reported() -> list[dict]:
            rows = json.loads(admin("trainers", "--json"))
            return rows if rows and rows[0]["page_ins"] >= 1 else []

        [row] = wait_until(reported, "the scheduler's beat to report a page-in", timeout=60)
        assert row["trainer"] == "engine" and row["budget_bytes"] == 1
        assert row["resident_runs"] == 1 and row["paged_runs"] == 2 and row["paged_bytes"] > 0
        assert row["page_ins_last_minute"] >= 1 and row["mean_page_in_seconds"] > 0 and row["page_outs"] >= 3
        assert row["prefetch_hits"] + row["prefetch_misses"] == row["page_ins"]  # read ahead, or on the cycle's path
        table = admin("trainers")
        assert "engine" in table and "paged runs" in table

        with server.embedded.sessions() as s:
            operator = issue_operator_key(s)
        overview = httpx.get(f"{server.base_url}/dashboard/api/admin/overview", headers={"X-API-Key": operator}).json()
        [shown] = overview["trainers"]
        assert shown["paged_runs"] == 2 and shown["resident_runs"] == 1
        assert shown["prefetch_hits"] + shown["prefetch_misses"] == shown["page_ins"]
    assert "no service is running" in admin("trainers")  # the beat's row goes with the server

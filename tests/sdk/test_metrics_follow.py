"""What `loraplex metrics follow` reads of a recipe's log folder: the run its checkpoints name, the rows of
metrics.jsonl as they are completed, and the numbers among them the server stores."""

from __future__ import annotations

import json

from loraplex.metrics_follow import numbers, rows, run_of


def test_the_run_is_the_one_the_checkpoints_name(tmp_path):
    assert run_of(tmp_path) is None
    (tmp_path / "checkpoints.jsonl").write_text(
        json.dumps({"name": "000010", "state_path": "tinker://abc:train:0/weights/000010", "batch": 10}) + "\n{")
    assert run_of(tmp_path) == "abc:train:0"


def test_only_finite_numbers_under_names_the_server_takes_are_sent():
    row = {"step": 3, "env/all/reward/total": 0.5, "optim/entropy": 2, "done": True, "note": "x",
           "time/total": float("nan"), "bad name!": 1.0, "progress/done_frac": 0.25}
    assert numbers(row) == {"env/all/reward/total": 0.5, "optim/entropy": 2.0, "progress/done_frac": 0.25}


def test_rows_come_whole_and_in_order_as_they_are_written(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps({"step": 0, "a": 1}) + "\n" + '{"step": 1, ')  # the second line half written
    reads = iter([False, True])  # nothing new once: write the rest; nothing new again: stop
    seen = []

    def idle() -> bool:
        done = next(reads)
        if not done:
            with path.open("a") as file:
                file.write('"a": 2}\n')
        return done

    for row in rows(path, follow=True, idle=idle, poll_seconds=0):
        seen.append(row)
    assert seen == [{"step": 0, "a": 1}, {"step": 1, "a": 2}]
    assert list(rows(tmp_path / "missing.jsonl", follow=False, idle=lambda: True)) == []

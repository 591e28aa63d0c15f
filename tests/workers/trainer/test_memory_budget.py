"""A trainer keeps the runs that fit its byte budget in memory and pages the least recently used out
to the store: a paged run continues bitwise as a never-paged twin does, and the numbers operators
read (workers/trainer/residency.py) say what happened."""

from __future__ import annotations

import os
from pathlib import Path

import prometheus_client
import pytest
import torch

from contract.queue import Cycle, Job
from service.settings import Settings
from storage.checkpoint_files import verify_training_state
from storage.live_slots import read_slots
from tests.workers.trainer.test_eviction import TOKENS, forward_backward, request, run
from workers.trainer.engine import TrainerEngine
from workers.trainer.executor import InProcessExecutor
from workers.trainer.process_executor import ProcessExecutor
from workers.trainer.residency import Residency, memory_budget, publish


def one_run_bytes(tiny_model_path, tmp_path) -> int:
    """What one stepped rank-4 run of the history holds in memory (weights, gradients, two moments)."""
    executor = InProcessExecutor(TrainerEngine(tiny_model_path, max_rank=16), tmp_path / "measure")
    run(executor)
    sizes = {a.resident_bytes for a in executor.engine.adapters.values()}
    executor.close()
    assert len(sizes) == 1  # the three runs have one shape
    return sizes.pop()


def test_a_budget_for_one_run_pages_the_others_and_changes_no_bit(tiny_model_path, tmp_path):
    kept, idle = run(InProcessExecutor(TrainerEngine(tiny_model_path, max_rank=16), tmp_path / "all"))
    assert idle == len(TOKENS) - 1  # no budget: every run stays
    # room for one stepped run (4x its weights), or two before their first step (no moments yet)
    budget = one_run_bytes(tiny_model_path, tmp_path)
    paged = InProcessExecutor(TrainerEngine(tiny_model_path, max_rank=16), tmp_path / "paged", memory_budget=budget)
    moved, idle = run(paged)
    assert moved == kept  # the logprobs after paging in and out, bit for bit
    assert idle == 1  # besides a cycle's own run, one more at most (before the step)
    stats = paged.residency_stats()
    assert stats.budget_bytes == budget and stats.resident_runs == 1 and stats.resident_bytes <= budget
    assert stats.paged_runs == len(TOKENS) - 1
    assert stats.page_outs >= stats.page_ins > 0 and stats.page_in_seconds > 0
    paged.close()


def test_a_cycle_whose_own_runs_exceed_the_budget_still_runs(tiny_model_path, tmp_path):
    """The history steps all three runs in one cycle: with room for less than one (the budget lowered since
    they were created) each runs alone, over the budget."""
    kept, _ = run(InProcessExecutor(TrainerEngine(tiny_model_path, max_rank=16), tmp_path / "all"))
    tight = InProcessExecutor(TrainerEngine(tiny_model_path, max_rank=16), tmp_path / "tight")
    moved, _ = run(tight, budget_after_creates=1)
    assert moved == kept and len(tight.engine.adapters) == 1  # the last cycle's run alone
    tight.close()


def test_the_least_recently_used_go_first_and_never_the_kept():
    residency = Residency(budget_bytes=250)
    for model_id in ("a", "b", "c"):
        residency.used(model_id)
    residency.used("a")  # now b is the oldest, then c
    resident = {"a": 100, "b": 100, "c": 100}
    assert residency.to_page_out(resident, keep=set(), incoming=set()) == ["b"]
    assert residency.to_page_out(resident, keep={"b"}, incoming=set()) == ["c"]
    residency.paged_out("b", 100)
    # b coming back counts with the bytes it left with: c and then a make room
    assert residency.to_page_out({"a": 100, "c": 100}, keep={"b"}, incoming={"b"}) == ["c"]
    assert Residency(budget_bytes=0).to_page_out(resident, keep=set(), incoming=set()) == []
    assert Residency(max_runs=1).to_page_out(resident, keep={"a"}, incoming=set()) == ["b", "c"]


def test_the_budget_is_the_setting_else_a_fraction_of_the_devices_memory(monkeypatch):
    cpu = torch.device("cpu")
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert memory_budget(None, 0.25, cpu) == int(ram * 0.25)
    assert memory_budget(None, 0.0, cpu) == 0  # no limit
    assert memory_budget(3 * 2**30, 0.25, cpu) == 3 * 2**30
    monkeypatch.setenv("LORAPLEX_TRAINER_MEMORY_BUDGET", "8GiB")
    assert Settings().trainer_memory_budget == 8 * 2**30
    monkeypatch.setenv("LORAPLEX_TRAINER_MEMORY_BUDGET", "lots")
    with pytest.raises(ValueError, match="trainer_memory_budget"):
        Settings()


def test_operators_read_the_residency_at_metrics(tiny_model_path, tmp_path):
    budget = one_run_bytes(tiny_model_path, tmp_path)
    executor = InProcessExecutor(TrainerEngine(tiny_model_path, max_rank=16), tmp_path / "paged", memory_budget=budget)
    stop = publish(executor.residency_stats)
    try:
        run(executor)
        sample = prometheus_client.REGISTRY.get_sample_value
        assert sample("loraplex_trainer_budget_bytes") == budget
        assert sample("loraplex_trainer_resident_runs") == 1
        assert sample("loraplex_trainer_paged_runs") == len(TOKENS) - 1
        assert sample("loraplex_trainer_page_in_seconds_count") == executor.residency_stats().page_ins > 0
        assert sample("loraplex_trainer_page_outs_total") == executor.residency_stats().page_outs
    finally:
        stop()
        executor.close()


@pytest.mark.slow  # an engine process starts
def test_an_engine_process_reports_its_residency_with_each_answer(tiny_model_path, tmp_path):
    from tests.workers.trainer.test_executor_parts import req

    executor = ProcessExecutor(tiny_model_path, 16, tmp_path / "live", memory_budget=(None, 0.25))
    try:
        create = req("m", 0, kind="create_model")
        body = b'{"lora_config": {"rank": 4}}'
        assert executor.run_cycle(Cycle(others=[create]), {create.id: Job(create, body)})[create.id].error is None
        stats = executor.residency_stats()  # no round trip: as of that answer
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        assert stats.budget_bytes == int(ram * 0.25) and stats.resident_runs == 1 and stats.resident_bytes > 0
    finally:
        executor.close()


def copies(executor: InProcessExecutor, model: str) -> int:
    return sum(1 for slot in read_slots(executor.live.live_dir, model) if slot.manifest is not None)


def test_a_paged_out_run_keeps_one_verified_copy_and_two_again_once_it_trains(tiny_model_path, tmp_path):
    budget = one_run_bytes(tiny_model_path, tmp_path)
    executor = InProcessExecutor(TrainerEngine(tiny_model_path, max_rank=16), tmp_path / "paged", memory_budget=budget,
                                 state_write_interval=0)
    run(executor)  # "a" and "b" are paged out by the end, "c" is resident
    for model in ("a", "b"):
        assert model not in executor.engine.adapters and copies(executor, model) == 1
        [slot] = [s for s in read_slots(executor.live.live_dir, model) if s.manifest]
        verify_training_state(slot.path)
    step, job = forward_backward("a", 5)
    assert executor.run_cycle(Cycle(forward_backward=[step]), {step.id: job})[step.id].error is None
    executor.live.writer.flush("a")
    assert copies(executor, "a") == 2  # training again, its previous state is kept beside the newest
    executor.close()


def test_a_damaged_lone_copy_fails_its_request_alone_and_is_made_again(tiny_model_path, tmp_path):
    """The run's history began with a create_model: `place` makes it again for the scheduler's replay."""
    from tests.workers.trainer.test_live_state_integrity import corrupt

    budget = one_run_bytes(tiny_model_path, tmp_path)
    executor = InProcessExecutor(TrainerEngine(tiny_model_path, max_rank=16), tmp_path / "paged", memory_budget=budget)
    run(executor)
    [slot] = [s for s in read_slots(executor.live.live_dir, "a") if s.manifest]
    corrupt(Path(slot.path), "flip")
    mine, my_job = forward_backward("a", 5)
    other, other_job = forward_backward("c", 5)
    outcomes = executor.run_cycle(Cycle(forward_backward=[mine, other]), {mine.id: my_job, other.id: other_job})
    assert outcomes[other.id].error is None
    assert outcomes[mine.id].error["category"] == "server"
    assert "failed its integrity check" in outcomes[mine.id].error["error"]
    assert "made again from its create_model at seq_id 0" in outcomes[mine.id].error["error"]
    assert executor.place({"a"}) == {"a"} and executor.durable_seq("a") == 0  # the scheduler replays 1-4
    executor.close()

"""Paged-out runs read back ahead of their cycle (workers/trainer/prefetch.py): the run continues bitwise as a
never-paged twin, a copy made stale by a newer write is never used, and the scheduler's hint reaches the
executor of an embedded server."""

from __future__ import annotations

import json

import numpy as np
import pytest

from contract.queue import Cycle, QueuedRequest
from loraplex.wire.client import decode_forward_backward_output
from scheduler.planner import CyclePlanner
from tests.waiting import wait_until
from tests.workers.trainer.test_eviction import TOKENS, forward_backward, history, request
from tests.workers.trainer.test_memory_budget import one_run_bytes
from workers.trainer.engine import TrainerEngine
from workers.trainer.executor import InProcessExecutor


def paged_executor(tiny_model_path, live, budget: int) -> InProcessExecutor:
    # room for one stepped run, and copies read ahead of two (a state on disk is at most a resident run's bytes,
    # plus its manifest)
    return InProcessExecutor(TrainerEngine(tiny_model_path, max_rank=16), live, memory_budget=budget,
                             prefetch_bytes=2 * budget)


def run_cycle(executor: InProcessExecutor, step: list) -> dict:
    kind = step[0][0].kind
    cycle = Cycle(forward_backward=[q for q, _ in step] if kind in ("forward", "forward_backward") else [],
                  optim_steps=[q for q, _ in step] if kind == "optim_step" else [],
                  others=[q for q, _ in step] if kind == "create_model" else [])
    outcomes = executor.run_cycle(cycle, {q.id: job for q, job in step})
    assert all(o.error is None for o in outcomes.values()), outcomes
    return outcomes


def logprobs(outcome) -> list[float]:
    return decode_forward_backward_output(outcome.result)[0][0]["logprobs"].tolist()


def run_prefetching(executor: InProcessExecutor) -> tuple[dict[str, list[float]], int]:
    """test_eviction's history, each cycle's paged-out runs read ahead (and waited for) before it runs: the
    forwards' logprobs per model, and how many runs were read ahead."""
    forwards, read_ahead = {}, 0
    for step in history():
        paged = [q.model_id for q, _ in step if executor.residency.is_paged(q.model_id)]
        executor.prefetch(paged)
        for model_id in paged:
            wait_until(lambda: executor.live.prefetcher.holds(model_id), f"{model_id} read ahead")
        read_ahead += len(paged)
        outcomes = run_cycle(executor, step)
        if step[0][0].kind == "forward":
            forwards[step[0][0].model_id] = logprobs(outcomes[step[0][0].id])
    return forwards, read_ahead


def test_a_prefetched_run_continues_bitwise_as_a_never_paged_twin(tiny_model_path, tmp_path):
    twin = InProcessExecutor(TrainerEngine(tiny_model_path, max_rank=16), tmp_path / "all")
    kept, none = run_prefetching(twin)  # nothing is paged: nothing read ahead
    twin.close()
    assert none == 0
    executor = paged_executor(tiny_model_path, tmp_path / "paged", one_run_bytes(tiny_model_path, tmp_path))
    moved, read_ahead = run_prefetching(executor)
    assert moved == kept  # paged in from copies read ahead: the same bits
    stats = executor.residency_stats()
    assert read_ahead > 0 and stats.prefetch_hits == read_ahead  # each copy read ahead was used by its cycle
    # the rest: the optim_step cycle runs its three runs one group after another, each paging the one before
    # out, and that one back in on the cycle's path (nothing hinted it)
    assert stats.prefetch_misses == stats.page_ins - read_ahead
    assert stats.prefetched_bytes == 0
    executor.close()


def test_a_copy_made_stale_by_a_newer_write_elsewhere_is_never_used(tiny_model_path, tmp_path):
    """"a" is read ahead here; meanwhile another trainer on the same store takes it over, steps it and hands
    it back (a newer slot). Its next cycle here must load that newer state, not the copy."""
    budget = one_run_bytes(tiny_model_path, tmp_path)
    here = paged_executor(tiny_model_path, tmp_path / "live", budget)
    run_prefetching(here)  # by its end "a" and "b" are paged out
    here.prefetch(["a"])
    wait_until(lambda: here.live.prefetcher.holds("a"), "a read ahead")

    other = InProcessExecutor(TrainerEngine(tiny_model_path, max_rank=16), tmp_path / "live")
    assert other.place({"a"}) == set()
    run_cycle(other, [forward_backward("a", 5)])
    run_cycle(other, [request("a", 6, "optim_step", json.dumps({"adam_params": {"learning_rate": 1e-2}}).encode())])
    q, job = forward_backward("a", 7, forward_only=True)
    stepped_there = logprobs(other.run_cycle(Cycle(forward_backward=[q]), {q.id: job})[q.id])
    other.evict("a")  # written whole, gradients included, to the store: it moves back
    other.close()

    before = here.residency_stats()
    q, job = forward_backward("a", 8, forward_only=True)
    assert logprobs(here.run_cycle(Cycle(forward_backward=[q]), {q.id: job})[q.id]) == stepped_there
    after = here.residency_stats()
    assert after.prefetch_hits == before.prefetch_hits and after.prefetch_misses == before.prefetch_misses + 1
    assert not here.live.prefetcher.holds("a") and after.prefetched_bytes == 0
    here.close()


def test_a_run_leaving_the_trainer_drops_its_copy_and_an_untaken_one_expires(tiny_model_path, tmp_path):
    budget = one_run_bytes(tiny_model_path, tmp_path)
    executor = paged_executor(tiny_model_path, tmp_path / "live", budget)
    run_prefetching(executor)  # "a", "b" paged out, "c" resident
    executor.prefetch(["a", "c"])  # "c" is in memory: nothing to read
    wait_until(lambda: executor.live.prefetcher.holds("a"), "a read ahead")
    assert not executor.live.prefetcher.holds("c")
    executor.evict("a")  # moved to another trainer (or deleted): its copy goes
    assert not executor.live.prefetcher.holds("a") and executor.residency_stats().prefetched_bytes == 0

    # a copy nobody takes (its run deleted, its request refused) gives way to newer hints
    prefetcher = executor.live.prefetcher
    prefetcher.ttl = 0.2
    executor.prefetch(["b"])
    wait_until(lambda: prefetcher.holds("b"), "b read ahead")
    _, room_for_a = executor.live._locate("a")
    prefetcher.allowance = room_for_a  # not for b's copy beside it
    executor.prefetch(["a"])
    wait_until(lambda: prefetcher.holds("a") and not prefetcher.holds("b"), "b's copy to expire for a's")
    executor.close()


def test_the_planner_names_the_runs_a_cycle_left_for_the_next():
    planner = CyclePlanner(token_budget=10, split_requests=False)
    runnable = {m: [QueuedRequest(f"{m}-1", f"tenant-{m}", m, 1, "forward_backward", 8)] for m in ("a", "b", "c")}
    cycle = planner.plan(runnable)
    planned = {q.model_id for q in cycle.all()}
    assert len(planned) == 1  # 8 tokens of a budget of 10: one request per cycle
    assert planner.upcoming(runnable, cycle) == [m for m in runnable if m not in planned]


@pytest.mark.slow  # a server trains two runs
def test_the_schedulers_hint_reaches_the_executor_of_an_embedded_server(tmp_path):
    """The trainer is held busy (its lock) while a paged-out run's request arrives: the hint has its state read
    ahead meanwhile, and its cycle pages it in from that copy."""
    import tinker
    from tinker import types

    from tests.servers import running_server

    tokens = TOKENS["a"]
    datum = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                        loss_fn_inputs={"target_tokens": np.array(tokens[1:]), "weights": np.ones(len(tokens) - 1)})
    with running_server(tmp_path, sampler_enabled=False, trainer_memory_budget=1,
                        trainer_prefetch_bytes=2**30) as server:
        executor = server.embedded.executor
        client = tinker.ServiceClient(base_url=server.base_url, api_key=server.new_tenant())
        executor.residency.budget_bytes = 0  # (a run larger than the budget is refused at create_model)
        runs = [client.create_lora_training_client(base_model="tiny", rank=4).result() for _ in range(2)]
        executor.residency.budget_bytes = 1  # from now on each run runs alone and pages the other out
        for run in runs:
            run.forward_backward([datum], "cross_entropy").result()
        first = runs[0].model_id
        assert executor.residency.is_paged(first)
        before = executor.residency_stats()  # (the step before may have been read ahead too: the race is not fixed)
        with executor._lock:  # the trainer is busy: the request waits, its state is read meanwhile
            future = runs[0].forward_backward([datum], "cross_entropy")
            wait_until(lambda: executor.live.prefetcher.holds(first), "the queued run's state read ahead")
        future.result()
        stats = executor.residency_stats()
        assert stats.prefetch_hits == before.prefetch_hits + 1 and stats.prefetch_misses == before.prefetch_misses
        assert stats.prefetched_bytes == 0


@pytest.mark.slow  # an engine process starts
def test_an_engine_process_gets_the_hints_with_its_next_cycle(tiny_model_path, tmp_path):
    from workers.trainer.process_executor import ProcessExecutor

    budget = one_run_bytes(tiny_model_path, tmp_path)
    executor = ProcessExecutor(tiny_model_path, 16, tmp_path / "live", memory_budget=(budget, 0.0),
                               prefetch_bytes=2 * budget)
    try:
        for step in history():  # by its end "a" and "b" are paged out, "c" is resident
            run_cycle(executor, step)
        executor.prefetch(["a"])  # kept until the next cycle, which is "c"'s: "a" is read meanwhile
        q, job = forward_backward("c", 5, forward_only=True)
        executor.run_cycle(Cycle(forward_backward=[q]), {q.id: job})
        wait_until(lambda: executor._call("residency_stats").prefetched_bytes > 0, "a read ahead in the child")
        before = executor.residency_stats()
        q, job = forward_backward("a", 5, forward_only=True)
        assert executor.run_cycle(Cycle(forward_backward=[q]), {q.id: job})[q.id].error is None
        after = executor.residency_stats()
        assert after.prefetch_hits == before.prefetch_hits + 1 and after.prefetch_misses == before.prefetch_misses
    finally:
        executor.close()

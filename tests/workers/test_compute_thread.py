"""The compute thread: every task on one thread, in order; short tasks let in at a long one's safe points."""

from __future__ import annotations

import threading
import time

import pytest
from prometheus_client import REGISTRY

from workers.compute_thread import ComputeThread, run_on


@pytest.fixture
def compute():
    thread = ComputeThread()
    yield thread
    thread.close()


def test_tasks_run_on_the_compute_thread_and_hand_back_results_and_errors(compute):
    assert compute.run(lambda: threading.current_thread().name) == "torch-compute"
    with pytest.raises(ZeroDivisionError):
        compute.run(lambda: 1 / 0)
    assert compute.run(lambda: 42) == 42  # a failed task does not stop the thread


def test_a_task_that_asks_for_the_compute_thread_runs_at_once(compute):
    # (queued behind itself it would wait forever)
    assert compute.run(lambda: compute.run(lambda: "inner") + " outer") == "inner outer"
    assert run_on(None, lambda: threading.current_thread().name) == threading.current_thread().name


def _submit_while(compute: ComputeThread, long_started: threading.Event, task=None,
                  **kwargs) -> tuple[list, threading.Thread]:
    """Once the long task has started, submit `task` (default: record the thread it ran on)."""
    ran: list[str] = []

    def submit() -> None:
        long_started.wait()
        compute.run(task or (lambda: ran.append(threading.current_thread().name)), **kwargs)

    thread = threading.Thread(target=submit)
    thread.start()
    return ran, thread


def _queued(compute: ComputeThread, count: int) -> None:
    while len(compute._tasks) < count:
        threading.Event().wait(0.001)


def test_interleave_tasks_run_inside_a_long_task_at_its_safe_point(compute):
    started = threading.Event()
    short, short_thread = _submit_while(compute, started, interleave=True)
    other, other_thread = _submit_while(compute, started)

    def long_task() -> tuple[list, list]:
        started.set()
        _queued(compute, 2)
        compute.interleave()  # a pass boundary
        return list(short), list(other)

    seen_short, seen_other = compute.run(long_task)
    short_thread.join()
    other_thread.join()
    assert seen_short == ["torch-compute"]  # ran in the middle of the long task, on the compute thread
    assert seen_other == [] and other == ["torch-compute"]  # an ordinary task waited for it to end


def test_close_finishes_what_was_queued_and_refuses_more():
    compute = ComputeThread()
    running, release = threading.Event(), threading.Event()
    ran = []  # in the order the tasks ran
    first = threading.Thread(target=lambda: compute.run(
        lambda: running.set() or release.wait(5) and ran.append("first")))
    first.start()
    running.wait(5)
    second = threading.Thread(target=lambda: compute.run(lambda: ran.append("second")))
    second.start()
    _queued(compute, 1)
    closing = threading.Thread(target=compute.close)
    closing.start()
    release.set()
    for t in (first, second, closing):
        t.join(10)
    assert ran == ["first", "second"]
    with pytest.raises(RuntimeError, match="closed"):
        compute.run(lambda: None)


def busy(work: str) -> float:
    return REGISTRY.get_sample_value("loraplex_compute_thread_busy_seconds_total", {"work": work}) or 0.0


def test_busy_time_is_counted_by_work_and_a_long_task_excludes_what_it_let_in(compute):
    started = threading.Event()
    _, step_thread = _submit_while(compute, started, lambda: time.sleep(0.3), work="sampler", interleave=True)
    trainer_before, sampler_before = busy("trainer"), busy("sampler")

    def long_task() -> None:
        started.set()
        _queued(compute, 1)
        compute.interleave()  # lets the 0.3 s sampler step in

    compute.run(long_task, work="trainer")
    step_thread.join()
    assert busy("sampler") - sampler_before >= 0.3
    assert 0 < busy("trainer") - trainer_before < 0.2  # its own time only, not the 0.3 s it let in

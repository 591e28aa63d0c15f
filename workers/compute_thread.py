"""One thread for a process's torch compute: the trainer's cycles and the sampler's steps.

Every thread that runs a parallel torch op on CPU gets an OpenMP thread team of its own from
libgomp. Once a process holds more OpenMP threads than CPUs (the trainer's team and the sampler's
on 2 cores, even with one of them idle), libgomp cuts its spin-wait to 100-1,000 spins, so its
workers sleep between parallel regions and every region pays a wake-up. On a 2-core VM
(2026-12-02) one idle second team made vLLM's decode GEMMs and the sampler's LoRA ops 1.7-2.6x
slower, mixed-adapter sampling 1.45x slower and a SmolLM2 training round 1.2x slower; the spin
settings of service/openmp.py did not help. Running both engines' torch work on this one thread
keeps a single team: they take turns instead of overlapping, each at full speed. On 2 cores the
overlap gained little anyway, since each slowed the other down by about as much.

Tasks run one at a time in the order they came. A long task (a trainer cycle of several passes)
lets short `interleave` tasks (the sampler's steps) run at its safe points (`interleave()`), so
sampling is not held up for a whole cycle. `loraplex_compute_thread_busy_seconds{work}` counts the
thread's time by the work each task names, a long task's without the tasks it let in.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import TypeVar

from prometheus_client import Counter

T = TypeVar("T")

BUSY_SECONDS = Counter("loraplex_compute_thread_busy_seconds", "Seconds the compute thread ran tasks, by work",
                       ["work"])


class ComputeThread:
    def __init__(self, name: str = "torch-compute") -> None:
        self._tasks: deque[tuple[Callable[[], object], Future, bool, str]] = deque()
        self._ready = threading.Condition()
        self._closed = False
        self._interleaved_seconds = 0.0  # time of the tasks run inside others, so far
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def on_it(self) -> bool:
        return threading.current_thread() is self._thread

    def run(self, fn: Callable[[], T], *, work: str = "other", interleave: bool = False) -> T:
        """`fn()` on the compute thread: its result, or its exception raised here. Called on the
        compute thread itself, it runs at once (its time counts to the task it is part of).
        work: the busy-time label ("trainer", "sampler"). `interleave`: a short task that may run
        inside a long one, at that one's safe points; it must not wait for anything a long task holds."""
        if self.on_it():
            return fn()
        future: Future = Future()
        with self._ready:
            if self._closed:
                raise RuntimeError("the compute thread is closed")
            self._tasks.append((fn, future, interleave, work))
            self._ready.notify()
        return future.result()

    def interleave(self) -> None:
        """At a safe point of a long task on the compute thread: run the interleave tasks waiting now."""
        if not self.on_it():
            return
        with self._ready:
            waiting = [task for task in self._tasks if task[2]]
            for task in waiting:
                self._tasks.remove(task)
        for fn, future, _, work in waiting:
            self._interleaved_seconds += self._execute(fn, future, work)

    def close(self) -> None:
        """Finish the tasks already queued, then stop the thread."""
        with self._ready:
            self._closed = True
            self._ready.notify()
        if not self.on_it():
            self._thread.join(timeout=60)

    def _loop(self) -> None:
        while True:
            with self._ready:
                while not self._tasks and not self._closed:
                    self._ready.wait()
                if not self._tasks:
                    return
                fn, future, _, work = self._tasks.popleft()
            self._execute(fn, future, work)

    def _execute(self, fn: Callable[[], object], future: Future, work: str) -> float:
        """Run one task; its wall time (busy time counted without the tasks it let in)."""
        if not future.set_running_or_notify_cancel():
            return 0.0
        start, let_in_before = time.perf_counter(), self._interleaved_seconds
        result, error = None, None
        try:
            result = fn()
        except BaseException as e:  # handed to the caller, who raises it
            error = e
        seconds = time.perf_counter() - start
        BUSY_SECONDS.labels(work).inc(seconds - (self._interleaved_seconds - let_in_before))  # before the caller wakes
        if error is None:
            future.set_result(result)
        else:
            future.set_exception(error)
        return seconds


def run_on(compute: ComputeThread | None, fn: Callable[[], T], *, work: str = "other", interleave: bool = False) -> T:
    """`fn()` on `compute`, or here when there is none."""
    return fn() if compute is None else compute.run(fn, work=work, interleave=interleave)

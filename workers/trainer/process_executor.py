"""An executor whose trainer engine lives in a child process.

Same cycles, same outcomes as `InProcessExecutor`, but the engine has its own interpreter, so
its Python work never competes for the GIL with the API serving other tenants' requests.
Messages are small pickled dataclasses (payloads and results are already bytes).

If the child dies (killed, out of memory), the cycle it was running fails with category "server",
a new child starts, and the models it had held are reported by `place` when next used, so the
scheduler replays their acknowledged gradients since their durable state (as after a restart).
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import threading
from pathlib import Path

from contract.queue import Cycle, Job, Outcome
from contract.residency import ResidencyStats
from storage import store
from workers.trainer.executor import InProcessExecutor
from workers.trainer.residency import memory_budget
from workers.trainer.shared_prefix import MIN_SHARED_TOKENS

log = logging.getLogger(__name__)


def _serve(conn, model_path: str, max_rank: int, live_dir: str, max_resident: int, budget: tuple[int | None, float],
           state_write_interval: float, min_shared_prefix: int, keep_glibc_malloc_defaults: bool,
           store_cache: str, prefetch_bytes: int | None) -> None:
    from workers.trainer.engine import TrainerEngine

    store.use_cache_dir(store_cache)  # the parent's: a spawned child starts with the default
    engine = TrainerEngine(model_path, max_rank=max_rank, min_shared_prefix=min_shared_prefix,
                           keep_glibc_malloc_defaults=keep_glibc_malloc_defaults)
    executor = InProcessExecutor(engine, live_dir, max_resident, state_write_interval,
                                 memory_budget=memory_budget(*budget, engine.device), prefetch_bytes=prefetch_bytes)
    conn.send(("ready", None))
    while True:
        try:
            method, args = conn.recv()
        except EOFError:  # the parent closed us
            executor.close()
            return
        try:
            # each answer brings the residency along: the parent's /metrics must not wait on a cycle for it
            conn.send(("ok", getattr(executor, method)(*args), executor.residency_stats()))
        except Exception as e:  # report, keep serving
            log.exception("%s failed in the engine process", method)
            conn.send(("error", f"{type(e).__name__}: {e}"))


class ProcessExecutor:
    # (contract.executor.Executor)
    engines_restart_with_scheduler = True  # the child ends with this process

    def __init__(self, model_path: Path, max_rank: int, live_dir: str | Path, start_timeout: float = 300,
                 max_resident: int = 0, memory_budget: tuple[int | None, float] = (0, 0.0),
                 state_write_interval: float = 0.0, min_shared_prefix: int = MIN_SHARED_TOKENS,
                 keep_glibc_malloc_defaults: bool = False, prefetch_bytes: int | None = None) -> None:
        """memory_budget: (bytes, or None for a fraction of the device's memory; that fraction), worked out
        in the child, which knows its device (workers/trainer/residency.py); prefetch_bytes: InProcessExecutor's."""
        self._args = (str(model_path), max_rank, str(live_dir), max_resident, memory_budget, state_write_interval,
                      min_shared_prefix, keep_glibc_malloc_defaults, str(store.cache_dir()), prefetch_bytes)
        self._start_timeout = start_timeout
        self._lock = threading.Lock()
        self._held: set[str] = set()  # models the current child has run
        self._lost: set[str] = set()  # models a dead child held
        self._residency = ResidencyStats.empty()
        self._hints: dict[str, None] = {}  # prefetch hints not yet sent to the child (it is busy with a cycle)
        self._start()

    def _start(self) -> None:
        ctx = mp.get_context("spawn")  # no fork: torch's thread pools do not survive it
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_serve, args=(child, *self._args), name="loraplex-engine", daemon=True)
        self._proc.start()
        child.close()  # so that recv() sees EOF when the child dies
        if not self._conn.poll(self._start_timeout) or self._conn.recv()[0] != "ready":
            raise RuntimeError("the engine process did not start")

    def _call(self, method: str, *args):
        with self._lock:
            try:
                self._conn.send((method, args))
                status, value, *residency = self._conn.recv()
            except (EOFError, OSError):  # the child died
                self._proc.join(timeout=10)
                code = self._proc.exitcode
                log.error("the engine process died (exit code %s); starting a new one", code)
                self._lost |= self._held
                self._held = set()
                self._start()
                raise EngineProcessLost(f"the engine process died (exit code {code})") from None
        if status != "ok":
            raise RuntimeError(value)
        self._residency = residency[0]
        return value

    def residency_stats(self) -> ResidencyStats:
        """As of the child's last answer (workers/trainer/residency.py)."""
        return self._residency

    def trainer_memory(self) -> dict[str, ResidencyStats]:
        return {"engine process": self._residency}

    def prefetch(self, model_ids: list[str]) -> None:
        """Kept, and sent to the child just before the next cycle, which it then overlaps (the pipe is the
        running cycle's until it answers)."""
        self._hints.update(dict.fromkeys(model_ids))

    def place(self, model_ids: set[str]) -> set[str]:
        """Of these models, those a dead engine process held, and those the child restored from an older
        stored state than they reached (the newest failed its integrity check): their work since their
        durable state must be replayed."""
        behind: set[str] = set()
        if self._proc.is_alive():  # (a dead one is found, and replaced, by the cycle it fails: run_cycle)
            try:  # one small round trip per cycle (0.05 ms): only the child knows what it holds in memory
                behind = self._call("place", model_ids)
            except RuntimeError:  # it died just now: its models are in _lost
                pass
        with self._lock:
            moved, self._lost = self._lost & model_ids, self._lost - model_ids
            return moved | behind

    def run_cycle(self, cycle: Cycle, jobs: dict[str, Job]) -> dict[str, Outcome]:
        hints, self._hints = self._hints, {}
        running = {q.model_id for q in cycle.all()}
        try:
            if hints.keys() - running:  # a one-way hint: read while this cycle computes
                self._call("prefetch", [m for m in hints if m not in running])
            outcomes = self._call("run_cycle", cycle, jobs)
        except EngineProcessLost as e:
            return {q.id: Outcome.failed(str(e), "server") for q in cycle.all()}
        self._held |= {q.model_id for q in cycle.all()}
        return outcomes

    def durable_seq(self, model_id: str, at_most: int | None = None) -> int | None:
        return self._call("durable_seq", model_id, at_most)

    def close(self) -> None:
        self._conn.close()
        self._proc.join(timeout=10)
        if self._proc.is_alive():
            self._proc.kill()


class EngineProcessLost(RuntimeError):
    pass

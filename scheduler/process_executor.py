"""An executor whose trainer engine lives in a child process.

Same cycles, same outcomes as `InProcessExecutor`, but the engine has its own interpreter, so
its Python work never competes for the GIL with the API serving other tenants' requests.
Messages are small pickled dataclasses (payloads and results are already bytes).
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import threading
from pathlib import Path

from scheduler.executor import InProcessExecutor, Job, Outcome
from scheduler.planner import Cycle

log = logging.getLogger(__name__)


def _serve(conn, model_path: str, max_rank: int, live_dir: str) -> None:
    from workers.trainer.engine import TrainerEngine

    executor = InProcessExecutor(TrainerEngine(model_path, max_rank=max_rank), Path(live_dir))
    conn.send(("ready", None))
    while True:
        try:
            method, args = conn.recv()
        except EOFError:
            return
        try:
            conn.send(("ok", getattr(executor, method)(*args)))
        except Exception as e:  # report, keep serving
            log.exception("%s failed in the engine process", method)
            conn.send(("error", f"{type(e).__name__}: {e}"))


class ProcessExecutor:
    def __init__(self, model_path: Path, max_rank: int, live_dir: Path, start_timeout: float = 300) -> None:
        ctx = mp.get_context("spawn")  # no fork: torch's thread pools do not survive it
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_serve, args=(child, str(model_path), max_rank, str(live_dir)),
                                 name="loraplex-engine", daemon=True)
        self._proc.start()
        self._lock = threading.Lock()
        if not self._conn.poll(start_timeout) or self._conn.recv()[0] != "ready":
            raise RuntimeError("the engine process did not start")

    def _call(self, method: str, *args):
        with self._lock:
            self._conn.send((method, args))
            status, value = self._conn.recv()  # EOFError if the engine process died
        if status != "ok":
            raise RuntimeError(value)
        return value

    def run_cycle(self, cycle: Cycle, jobs: dict[str, Job]) -> dict[str, Outcome]:
        return self._call("run_cycle", cycle, jobs)

    def durable_seq(self, model_id: str) -> int | None:
        return self._call("durable_seq", model_id)

    def close(self) -> None:
        self._conn.close()
        self._proc.join(timeout=10)
        if self._proc.is_alive():
            self._proc.kill()

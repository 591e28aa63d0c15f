"""Per-model seq_id order: a reorder buffer that releases each model's requests strictly in order.

The Tinker SDK numbers a model's operations 1, 2, 3, ... and may send them out of order (the
chunks of a large forward_backward go concurrently, first chunk last). Creation (create_model or
a create-via-load) is seq 0. A request is runnable only when every earlier seq_id of its model
has finished, successfully or not: a failed request never blocks the next one.

A request refused at the door still passes its seq_id (api/refusals.py records it). A seq_id that
never arrives (lost by the client, or refused without a live key) would hold its model's later
requests forever: `stalled` reports such gaps once later requests have waited behind them for a
while, and the scheduler applies its gap rule (scheduler/service.py, `_skip_stalled_gaps`).
"""

from __future__ import annotations

from contract.kinds import BATCHABLE_KINDS
from contract.queue import QueuedRequest


class ReorderBuffer:
    def __init__(self) -> None:
        self._waiting: dict[str, dict[int, QueuedRequest]] = {}  # model -> seq_id -> request
        self._next_seq: dict[str, int] = {}  # model -> next seq_id to run
        self._running: dict[str, set[int]] = {}  # models with requests in flight -> their seq_ids
        self._gap_seen: dict[str, tuple[int, float]] = {}  # model -> (missing next seq_id, first seen at)

    def add(self, request: QueuedRequest, next_seq: int | None = None) -> None:
        """Queue a request; `next_seq` tells a model's position the first time it is seen."""
        if next_seq is not None:
            self._next_seq.setdefault(request.model_id, next_seq)
        self._next_seq.setdefault(request.model_id, 0)
        if request.seq_id < self._next_seq[request.model_id]:
            raise ValueError(f"{request.model_id} seq_id {request.seq_id} already ran")
        if request.seq_id in self._running.get(request.model_id, ()):
            return  # a second copy of a request in flight (it may arrive twice around a restart)
        self._waiting.setdefault(request.model_id, {})[request.seq_id] = request

    def next_seq(self, model_id: str) -> int:
        return self._next_seq[model_id]

    def knows(self, model_id: str) -> bool:
        return model_id in self._next_seq

    def runnable(self) -> dict[str, list[QueuedRequest]]:
        """For each idle model, the requests it may run now: its next request, extended by the
        following consecutive requests while all of them are batchable (forward/backward)."""
        ready = {}
        for model_id, waiting in self._waiting.items():
            if model_id in self._running:
                continue
            seq = self._next_seq[model_id]
            head = waiting.get(seq)
            if head is None:
                continue
            run = [head]
            while head.kind in BATCHABLE_KINDS:
                nxt = waiting.get(run[-1].seq_id + 1)
                if nxt is None or nxt.kind not in BATCHABLE_KINDS:
                    break
                run.append(nxt)
            ready[model_id] = run
        return ready

    def stalled(self, now: float, after_seconds: float) -> list[QueuedRequest]:
        """Models whose next seq_id has been missing for `after_seconds` while later ones wait:
        for each, the first request waiting behind the gap."""
        stalled = []
        for model_id, waiting in self._waiting.items():
            seq = self._next_seq[model_id]
            if model_id in self._running or not waiting or seq in waiting:
                self._gap_seen.pop(model_id, None)
                continue
            gap = self._gap_seen.get(model_id)
            if gap is None or gap[0] != seq:
                self._gap_seen[model_id] = gap = (seq, now)
            if now - gap[1] >= after_seconds:
                stalled.append(waiting[min(waiting)])
        return stalled

    def start(self, requests: list[QueuedRequest]) -> None:
        """Mark requests as dispatched; their model runs nothing else until `finish`."""
        for r in requests:
            self._running.setdefault(r.model_id, set()).add(r.seq_id)
            del self._waiting[r.model_id][r.seq_id]

    def finish(self, requests: list[QueuedRequest]) -> None:
        for r in requests:
            self._running.pop(r.model_id, None)
            self._next_seq[r.model_id] = max(self._next_seq[r.model_id], r.seq_id + 1)
            if not self._waiting.get(r.model_id):
                self._waiting.pop(r.model_id, None)

    def forget(self, model_id: str) -> None:
        self._waiting.pop(model_id, None)
        self._next_seq.pop(model_id, None)
        self._running.pop(model_id, None)
        self._gap_seen.pop(model_id, None)

    def __len__(self) -> int:
        return sum(len(w) for w in self._waiting.values())

"""Reading paged-out runs back ahead of their cycle: a background thread, bounded host buffers.

The scheduler tells the executor which runs its queued requests need (`want`, a hint). This thread
reads each one's newest stored state and verifies it against its SHA-256 manifest while the compute
thread keeps computing, and keeps it in host memory, up to `allowance` bytes (beside the memory
budget, docs/memory.md): on CPU as the very adapter the cycle will train (built here: that was half
a page-in's time), on a GPU as verified host tensors. The cycle that pages the run in then only
installs it (`take`, from LiveStates.restore), instead of reading, hashing and building on its path.

Never used stale: a copy is used only for the slot restore picks, with the very manifest it was
verified against (the manifest holds the tensors' SHA-256, so the bytes are the ones stored there
now); every change of the run's state (`discard`: written again, moved, made anew) and every restore
(`take`) bumps its epoch, so a read begun before it is thrown away when it ends. A copy nobody takes
(the run was deleted, or its request refused) goes after `ttl` seconds once room is needed.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from storage.live_slots import Slot

log = logging.getLogger(__name__)

TTL_SECONDS = 60.0  # an untaken copy gives way to newer hints after this long


@dataclass(frozen=True)
class Prefetched:
    """A run's stored state read ahead: the slot it came from, its manifest as verified, and what `load` made
    of it (LiveStates: the adapter, or the tensors)."""

    path: str
    manifest: dict
    loaded: object
    nbytes: int
    read_at: float  # monotonic

    def matches(self, slot: Slot) -> bool:
        """The same slot holding the same state (its manifest names the tensors' SHA-256)."""
        return slot.path == self.path and slot.manifest == self.manifest


class Prefetcher:
    def __init__(self, locate: Callable[[str], tuple[Slot, int] | None],
                 load: Callable[[str, Slot], tuple[dict, object, int]], allowance: int, ttl: float = TTL_SECONDS) -> None:
        """On this thread: locate, the slot a run would be restored from and the most bytes its copy may take
        (None: the run is resident, or has no stored state); load, the slot's verified manifest, what it is
        loaded as, and its bytes (CheckpointError if it does not verify). allowance: the most bytes of copies
        held (and being read)."""
        self._locate = locate
        self._load = load
        self.allowance = allowance
        self.ttl = ttl
        self._wanted: OrderedDict[str, None] = OrderedDict()  # hinted runs, oldest hint first
        self._held: dict[str, Prefetched] = {}
        self._epoch: dict[str, int] = {}  # run -> bumped by take/discard: a read begun before is dropped
        self._reading: str | None = None  # the run being read now (room reserved for it)
        self._reserved = 0
        self._closed = False
        self._changed = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="state-prefetch", daemon=True)
        self._thread.start()

    @property
    def held_bytes(self) -> int:
        """The copies held, and the one being read."""
        return sum(p.nbytes for p in list(self._held.values())) + self._reserved

    def holds(self, model_id: str) -> bool:
        return model_id in self._held

    def want(self, model_ids: Iterable[str]) -> None:
        """Read these runs ahead, in this order after those hinted before (a hint, never waited for)."""
        with self._changed:
            for model_id in model_ids:
                if model_id not in self._held and model_id != self._reading:
                    self._wanted[model_id] = None
            self._changed.notify_all()

    def take(self, model_id: str) -> Prefetched | None:
        """The run's copy read ahead, for its restore (waits for it if it is being read now); None if none.
        Either way the run is no longer wanted: its restore reads it now."""
        with self._changed:
            self._wanted.pop(model_id, None)
            self._changed.wait_for(lambda: self._reading != model_id)
            self._bump(model_id)
            copy = self._held.pop(model_id, None)
            self._changed.notify_all()
            return copy

    def discard(self, model_id: str) -> None:
        """The run's stored state changes, or the run leaves this trainer: no copy of it may be used."""
        with self._changed:
            self._wanted.pop(model_id, None)
            self._bump(model_id)
            self._held.pop(model_id, None)
            self._changed.notify_all()

    def close(self) -> None:
        with self._changed:
            self._closed = True
            self._held.clear()
            self._changed.notify_all()
        self._thread.join(timeout=30)

    def _bump(self, model_id: str) -> None:
        self._epoch[model_id] = self._epoch.get(model_id, 0) + 1

    def _run(self) -> None:
        while True:
            with self._changed:
                self._changed.wait_for(lambda: self._wanted or self._closed)
                if self._closed:
                    return
                model_id, _ = self._wanted.popitem(last=False)
                epoch = self._epoch.get(model_id, 0)
            try:
                self._read(model_id, epoch)
            except Exception as e:  # a failed read is a miss: the restore reads (and reports) it itself
                log.debug("prefetching %s failed: %s", model_id, e)
            finally:
                with self._changed:
                    if self._reading == model_id:
                        self._reading, self._reserved = None, 0
                    self._changed.notify_all()

    def _read(self, model_id: str, epoch: int) -> None:
        located = self._locate(model_id)
        if located is None:
            return
        slot, nbytes = located
        if not self._make_room(model_id, epoch, nbytes):
            return
        manifest, loaded, nbytes = self._load(model_id, slot)
        if manifest != slot.manifest:  # rewritten since it was located
            return
        with self._changed:
            if self._epoch.get(model_id, 0) == epoch and not self._closed:
                self._held[model_id] = Prefetched(slot.path, manifest, loaded, nbytes, time.monotonic())

    def _make_room(self, model_id: str, epoch: int, nbytes: int) -> bool:
        """Reserve room for the run's copy, waiting for copies to be taken or to expire; False if the run
        changed meanwhile (taken, discarded) or the copy could never fit."""
        if nbytes > self.allowance:
            return False
        with self._changed:
            while True:
                if self._closed or self._epoch.get(model_id, 0) != epoch:
                    return False
                now = time.monotonic()
                for expired in [m for m, p in self._held.items() if now - p.read_at > self.ttl]:
                    del self._held[expired]
                if self.held_bytes + nbytes <= self.allowance:
                    self._reading, self._reserved = model_id, nbytes
                    return True
                oldest = min(p.read_at for p in self._held.values())
                self._changed.wait(timeout=max(0.01, oldest + self.ttl - now))

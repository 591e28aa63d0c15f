"""Executors run a planned cycle on a trainer engine and return one outcome per request.

The scheduler only decides; an executor only executes. `InProcessExecutor` calls the engine in
this process (embedded mode); the distributed mode sends the same cycle to a Celery worker.
Payloads are the bodies the API accepted: protobuf for forward/backward, and for the other
operations a JSON body the API already validated and resolved (checkpoint paths, LoRA config).

Durability: each adapter's training state is kept in `live_dir` (a folder of the checkpoint store:
a local path or an fsspec URL, workers/store.py), when and how scheduler/live_state.py says. After
a restart an adapter is reloaded from there, and the forward_backward and optim_step requests it
had finished since (their effects were only in memory) are replayed by the scheduler.

Eviction (to make room, or to move the adapter to another worker) writes the adapter's full state,
accumulated gradients included, marked with the last seq_id it ran, then drops it from memory:
whoever loads it next continues exactly where it stopped, with nothing to replay.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loraplex.wire.codec import decode_forward_backward_request, encode_forward_backward_output
from scheduler.ordering import REJECTED, QueuedRequest
from scheduler.planner import Cycle
from scheduler.live_state import LiveStates
from workers.trainer.adapters import AdamParams, LoraConfig
from workers.trainer.batch import Datum, ForwardBackwardInput
from workers import store
from workers.compute_thread import ComputeThread, run_on
from workers.trainer.checkpoints import read_manifest
from workers.trainer.engine import TrainerEngine
from workers.trainer.errors import EngineError

log = logging.getLogger(__name__)

PROTOBUF = "application/x-protobuf"
JSON = "application/json"


@dataclass(frozen=True)
class Outcome:
    result: bytes | None = None
    content_type: str | None = None
    error: dict[str, str] | None = None  # {"error": message, "category": "user" | "server"}
    checkpoint: dict[str, Any] | None = field(default=None)  # a checkpoint written, for the scheduler to record

    @classmethod
    def json(cls, value: dict[str, Any], checkpoint: dict[str, Any] | None = None) -> "Outcome":
        return cls(json.dumps(value).encode(), JSON, checkpoint=checkpoint)

    @classmethod
    def failed(cls, message: str, category: str) -> "Outcome":
        return cls(error={"error": message, "category": category})


@dataclass(frozen=True)
class Job:
    """A request and its payload."""

    request: QueuedRequest
    payload: bytes


def engine_input(job: Job) -> ForwardBackwardInput:
    wire = decode_forward_backward_request(job.payload, None)
    return ForwardBackwardInput(
        adapter_id=job.request.model_id,
        data=[Datum(d.tokens, dict(d.loss_fn_inputs)) for d in wire.data],
        loss_fn=wire.loss_fn,
        loss_fn_config=dict(wire.loss_fn_config),
        forward_only=job.request.kind == "forward",
    )


class InProcessExecutor:
    # The executor interface the scheduler uses: run_cycle, durable_seq, place, and this flag
    # (ProcessExecutor and CeleryExecutor have the same).
    engines_restart_with_scheduler = True  # a restart loses the in-memory gradients: replay them

    def __init__(self, engine: TrainerEngine, live_dir: str | Path, max_resident: int = 0,
                 state_write_interval: float = 0.0, compute: ComputeThread | None = None) -> None:
        """compute: the thread the engine's work runs on, shared with the sampler's steps, which it
        lets in between passes (workers/compute_thread.py); None: the calling thread."""
        self.engine = engine
        self.max_resident = max_resident  # adapters kept in memory (0: no limit); the least recently used go
        self._last_seq: OrderedDict[str, int] = OrderedDict()  # resident models, least recently used first
        self._lock = threading.RLock()  # the engine's: held while a cycle or an eviction runs
        self._compute = compute
        if compute is not None:
            engine.between_passes = compute.interleave
        self.live = LiveStates(engine, live_dir, self._lock, state_write_interval, compute)

    def close(self) -> None:
        """Capture the durable states not yet captured and finish writing them."""
        self.live.close()

    def place(self, model_ids: set[str]) -> set[str]:
        """The models whose engine died since they last ran (never, in this process)."""
        return set()

    # --- durability ------------------------------------------------------------------------------

    def durable_seq(self, model_id: str) -> int | None:
        return self.live.durable_seq(model_id)

    def _ensure_loaded(self, model_ids: set[str]) -> None:
        for model_id in model_ids:
            if model_id not in self.engine.adapters and read_manifest(self.live.path(model_id)) is not None:
                self.engine.load_state(model_id, self.live.path(model_id))
        if self.max_resident:
            idle = [m for m in self._last_seq if m not in model_ids]
            for model_id in idle[: max(0, len(self.engine.adapters) - self.max_resident)]:
                self._evict(model_id)  # (this cycle holds the lock, maybe on the compute thread)

    def evict(self, model_id: str) -> None:
        """Write the adapter's full state (gradients included) and drop it from memory."""
        with self._lock:
            run_on(self._compute, lambda: self._evict(model_id), work="trainer")

    def _evict(self, model_id: str) -> None:
        if model_id not in self.engine.adapters:
            return
        last_seq = self._last_seq.pop(model_id, None)
        if last_seq is not None:  # else: nothing ran since it was loaded; the stored state is current
            self.live.persist(model_id, last_seq, with_gradients=True)
        self.live.forget(model_id)
        self.engine.delete_adapter(model_id)

    # --- cycles ----------------------------------------------------------------------------------

    def run_cycle(self, cycle: Cycle, jobs: dict[str, Job]) -> dict[str, Outcome]:
        with self._lock:
            return run_on(self._compute, lambda: self._run_cycle(cycle, jobs), work="trainer")

    def _run_cycle(self, cycle: Cycle, jobs: dict[str, Job]) -> dict[str, Outcome]:
        self._ensure_loaded({r.model_id for r in cycle.all()})
        outcomes: dict[str, Outcome] = {}
        if cycle.forward_backward:
            outcomes.update(self._forward_backward([jobs[r.id] for r in cycle.forward_backward]))
        if cycle.optim_steps:
            outcomes.update(self._optim_steps([jobs[r.id] for r in cycle.optim_steps]))
        for request in cycle.others:
            outcomes[request.id] = self._guarded(self._other, jobs[request.id])
        for request in cycle.all():  # requests of one model run in seq_id order
            if request.model_id in self.engine.adapters:
                self._last_seq[request.model_id] = max(self._last_seq.get(request.model_id, -1), request.seq_id)
                self._last_seq.move_to_end(request.model_id)
        return outcomes

    def _forward_backward(self, jobs: list[Job]) -> dict[str, Outcome]:
        try:
            results = self.engine.forward_backward([engine_input(job) for job in jobs])
        except Exception as e:  # a bug or resource failure: every request of the batch fails, clearly
            log.exception("batched forward_backward failed")
            return {job.request.id: Outcome.failed(f"forward_backward failed: {e}", "server") for job in jobs}
        outcomes = {}
        for job, result in zip(jobs, results):
            if isinstance(result, EngineError):
                outcomes[job.request.id] = Outcome.failed(str(result), result.category)
            else:
                outputs = [{k: v.numpy() for k, v in o.items()} for o in result.loss_fn_outputs]
                outcomes[job.request.id] = Outcome(encode_forward_backward_output(outputs, result.metrics), PROTOBUF)
        return outcomes

    def _optim_steps(self, jobs: list[Job]) -> dict[str, Outcome]:
        steps = [(job.request.model_id, AdamParams(**json.loads(job.payload)["adam_params"])) for job in jobs]
        outcomes = {}
        for job, result in zip(jobs, self.engine.optim_step(steps)):
            if isinstance(result, EngineError):
                outcomes[job.request.id] = Outcome.failed(str(result), result.category)
                continue
            self.live.stepped(job.request.model_id, job.request.seq_id)
            outcomes[job.request.id] = Outcome.json({"metrics": {f"{k}:mean": v for k, v in result.items()}})
        return outcomes

    def _guarded(self, fn, job: Job) -> Outcome:
        try:
            return fn(job)
        except EngineError as e:
            return Outcome.failed(str(e), e.category)
        except Exception as e:
            log.exception("%s failed", job.request.kind)
            return Outcome.failed(f"{job.request.kind} failed: {e}", "server")

    def _other(self, job: Job) -> Outcome:
        body = json.loads(job.payload)
        model_id, kind = job.request.model_id, job.request.kind
        if kind == REJECTED:  # only its seq_id passes, nothing runs
            return Outcome.failed(body["error"], body["category"])
        if kind == "create_model":
            self.engine.create_adapter(model_id, LoraConfig(**body["lora_config"]))
            self.live.persist(model_id, job.request.seq_id)
            return Outcome.json({"model_id": model_id, "type": "create_model"})
        if kind == "load_weights":
            self.engine.load_state(model_id, body["storage_path"], with_optimizer=body["optimizer"])
            self.live.persist(model_id, job.request.seq_id)
            return Outcome.json({"path": body["tinker_path"], "model_id": model_id, "type": "load_weights"})
        if kind in ("save_weights", "save_weights_for_sampler"):
            location = body["storage_path"]
            if kind == "save_weights":
                self.engine.save_state(model_id, location)
            else:
                self.engine.save_sampler_weights(model_id, location)
            checkpoint = {k: body[k] for k in ("kind", "name", "tinker_path", "ttl_seconds")}
            checkpoint.update(storage_path=location, size_bytes=store.size(location))
            if body.get("sampling_session_id"):  # ephemeral snapshot for save_weights_and_get_sampling_client
                result = {"sampling_session_id": body["sampling_session_id"], "type": kind}
            else:
                result = {"path": body["tinker_path"], "type": kind}
            return Outcome.json(result, checkpoint=checkpoint)
        raise EngineError(f"{kind} is not supported by this server yet")

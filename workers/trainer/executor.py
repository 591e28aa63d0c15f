"""The executor that runs planned cycles on a trainer engine, one outcome per request.

The scheduler only decides; an executor only executes (contract/executor.py is what the scheduler
sees of one). `InProcessExecutor` calls its engine in the calling process: the embedded server's,
an engine process's (workers/trainer/process_executor.py) and each Celery trainer worker's
(service/celery_worker.py). Payloads are the bodies the API accepted: protobuf for forward/backward,
and for the other operations a JSON model of contract/payloads.py, already checked and resolved
(checkpoint paths, LoRA config).

Durability: each adapter's training state is kept in `live_dir` (a folder of the checkpoint store:
a local path or an fsspec URL, storage/store.py), when and how workers/trainer/live_state.py says. After
a restart an adapter is reloaded from there, and the forward_backward and optim_step requests it
had finished since (their effects were only in memory) are replayed by the scheduler. A stored
state that fails its integrity check is passed over for the previous one, and `place` reports the
model so that the scheduler replays the requests after that one first; a model with no usable
state left fails its requests alone, with a message saying what was found and what to do.

Eviction (paging out to stay within the memory budget, workers/trainer/residency.py; or moving the
adapter to another worker) writes the adapter's full state, accumulated gradients included, marked
with the last seq_id it ran, then drops it from memory: whoever loads it next continues exactly where
it stopped, with nothing to replay. Paging back in can begin before the cycle: `prefetch` (a hint from
the scheduler: runs its queued requests need) reads and verifies paged-out states on a background
thread, into host buffers of at most `prefetch_bytes` (workers/trainer/prefetch.py), and the cycle only
copies them in.

A request larger than a cycle comes in parts (`Job.part`, scheduler/planner.py): the executor
validates it whole at its first part, runs each part with passes of its own, keeps the parts'
results and answers `Outcome.progress` until the last part, which answers the merged result
(workers/trainer/parts.py). What ran stays with the engine that ran it, so a part sent again (the
scheduler restarted, but this engine did not: a Celery worker) is answered from there, never run
twice; a model halfway through such a request is never evicted or moved (`splitting`).

Whole requests sent again (`answer_resent`, on for engines that outlive the scheduler: a Celery
worker): a scheduler killed after this engine ran a cycle but before it committed the outcomes sends
the cycle again after its restart (its requests are still pending). Running a forward_backward or an
optim_step again would apply its gradient or step twice, so the executor keeps, per model, the
outcomes of the last cycle that ran it (`_last_cycle`), and answers a request found there from it.
A model runs nothing else until its requests are stored, so that is all a resend can ask for; the
record goes when the model's next, different request arrives, or when the model leaves memory.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import replace
from pathlib import Path

from loraplex.wire.codec import PROTOBUF, decode_forward_backward_request, encode_forward_backward_output

from contract.errors import EngineError, InvalidInputError
from contract.inputs import ForwardBackwardInput, from_wire
from contract.kinds import RequestKind
from contract.payloads import CreateModelPayload, LoadWeightsPayload, OptimStepPayload, SaveWeightsPayload
from contract.queue import Cycle, Job, Outcome
from contract.residency import ResidencyStats
from storage import store
from storage.checkpoint_files import CheckpointError
from storage.live_slots import LiveStateError
from workers.compute_thread import ComputeThread, run_on
from workers.host_memory import release_freed_host_memory
from workers.trainer.batch import EngineOutput
from workers.trainer.engine import TrainerEngine
from workers.trainer.live_state import LiveStates
from workers.trainer.parts import SplitRun
from workers.trainer.residency import Residency
from workers.trainer.run_metrics import forward_backward_metrics, optim_step_metrics

log = logging.getLogger(__name__)

# kinds that run without the model's stored state: they replace it (a rejected one runs nothing)
REPLACES_STATE = (RequestKind.CREATE_MODEL, RequestKind.LOAD_WEIGHTS, RequestKind.REJECTED)
# kinds that change a model's training state in memory (gradients, or weights and moments)
CHANGES_STATE = (RequestKind.FORWARD_BACKWARD, RequestKind.OPTIM_STEP)
PREFETCH_SHARE = 4  # by default, states read ahead take up to a quarter of the memory budget, beside it


def encoded(result: EngineOutput) -> Outcome:
    outputs = [{k: v.numpy() for k, v in o.items()} for o in result.loss_fn_outputs]
    return Outcome(encode_forward_backward_output(outputs, result.metrics), PROTOBUF)


def engine_input(job: Job) -> ForwardBackwardInput:
    """The engine's input for a forward/forward_backward job (its payload is the protobuf body)."""
    return from_wire(decode_forward_backward_request(job.payload, None))


class InProcessExecutor:
    # (contract.executor.Executor, as ProcessExecutor and CeleryExecutor)
    engines_restart_with_scheduler = True  # a restart loses the in-memory gradients: replay them

    def __init__(self, engine: TrainerEngine, live_dir: str | Path, max_resident: int = 0,
                 state_write_interval: float = 0.0, compute: ComputeThread | None = None,
                 answer_resent: bool = False, memory_budget: int = 0, prefetch_bytes: int | None = None) -> None:
        """max_resident, memory_budget: the most runs, and bytes of their state, kept in memory (0: no
        limit); the least recently used are paged out to `live_dir` (workers/trainer/residency.py).
        prefetch_bytes: the most bytes of paged-out states read ahead of their cycle (`prefetch`), beside
        the budget (None: a quarter of memory_budget; 0: none).
        compute: the thread the engine's work runs on, shared with the sampler's steps, which it
        lets in between passes (workers/compute_thread.py); None: the calling thread.
        answer_resent: answer a request of the model's last cycle, sent again, from its outcome instead of
        running it twice (for an engine that outlives the scheduler; an embedded engine restarts with it,
        and the scheduler's replay rebuilds what it held)."""
        self.engine = engine
        self.residency = Residency(memory_budget, max_resident)
        self._last_seq: dict[str, int] = {}  # resident model -> the last seq_id it ran (none: nothing since loaded)
        # model -> its forward/forward_backward run here in parts (one at most: the model runs nothing
        # else meanwhile), kept once complete until the model's next request, for a resent part's answer
        self._splits: dict[str, SplitRun] = {}
        # model -> {request id: outcome} of the last cycle that ran the model, while its outcomes may not be
        # committed yet (`answer_resent`). One cycle per model: a few outcomes each, logprobs included.
        self.answer_resent = answer_resent
        self.capture_metrics = True  # the dashboard's numbers on each outcome (off: benchmarks/metric_capture.py)
        self._last_cycle: dict[str, dict[str, Outcome]] = {}
        self._lock = threading.RLock()  # the engine's: held while a cycle or an eviction runs
        self._compute = compute
        if compute is not None:
            engine.between_passes = compute.interleave
        if prefetch_bytes is None:
            prefetch_bytes = memory_budget // PREFETCH_SHARE
        self.live = LiveStates(engine, live_dir, self._lock, state_write_interval, compute, busy=self.splitting,
                               prefetch_bytes=prefetch_bytes)

    def close(self) -> None:
        """Capture the durable states not yet captured and finish writing them."""
        self.live.close()

    def prefetch(self, model_ids: list[str]) -> None:
        """A hint: these runs' requests are queued. Those paged out are read back and verified in the
        background (not on the compute thread, no lock), for their cycle to copy in; never waited for."""
        self.live.prefetch([m for m in model_ids if m not in self.engine.adapters])

    def place(self, model_ids: set[str]) -> set[str]:
        """Load the models that are not in memory, but those this trainer paged out itself (they load with
        their group in run_cycle, within the memory budget); of them, those whose newest stored state failed
        its integrity check and were restored from an older one: the scheduler replays their requests after
        it (`durable_seq`) before they run again. (No engine dies in this process.)"""
        if all(m in self.engine.adapters for m in model_ids):  # the usual case: no lock, no hop
            return set()
        with self._lock:
            return run_on(self._compute, lambda: self._restore_behind(model_ids), work="trainer")

    def _restore_behind(self, model_ids: set[str]) -> set[str]:
        # A run this trainer paged out itself left its current state behind: it loads with its group in
        # run_cycle (within the budget, counted as a page-in). The others (after a restart) load here.
        missing = {m for m in model_ids - set(self.engine.adapters) if not self.residency.is_paged(m)}
        self._page_out(keep=model_ids, incoming=missing)
        behind = set()
        for model_id in sorted(missing):
            try:
                restored = self.live.restore(model_id)
            except LiveStateError:
                continue  # its requests fail in run_cycle, saying why
            if restored is not None and restored.behind:
                log.warning("%s: restored from its state after seq_id %d (%s); replaying the requests after it",
                            model_id, restored.seq, "; ".join(restored.problems) or "newer state not found")
                self.live.restart_from(model_id, restored.seq)
                behind.add(model_id)
        return behind

    # --- durability ------------------------------------------------------------------------------

    def durable_seq(self, model_id: str, at_most: int | None = None) -> int | None:
        return self.live.durable_seq(model_id, at_most)

    def _restore_states(self, cycle: Cycle) -> tuple[Cycle, dict[str, Outcome]]:
        """Load the cycle's models that are not in memory from their stored state. A model whose state
        cannot be restored, or only from an older state than it reached (the requests after that one
        must be replayed first: `place` has the scheduler do it), fails this cycle's requests alone:
        the cycle without them, and their outcomes."""
        unavailable: dict[str, Outcome] = {}
        needed = {q.model_id for q in cycle.all() if q.kind not in REPLACES_STATE}
        self._page_out(keep={q.model_id for q in cycle.all()}, incoming=needed - set(self.engine.adapters))
        for model_id in sorted(needed - set(self.engine.adapters)):
            started = time.perf_counter()
            try:
                restored = self.live.restore(model_id)
            except LiveStateError as e:
                log.error("%s", e)
                unavailable[model_id] = Outcome.failed(str(e), e.category)
                self.residency.forget(model_id)  # (`place` tries it again, as any run not paged out here)
                continue
            if restored is None:
                unavailable[model_id] = Outcome.failed(
                    f"adapter_id: model {model_id} has no training state on this server: its create_model or "
                    f"load_weights failed, or its stored state was lost (an operator can rebuild it: "
                    f"`loraplex-admin models rebuild {model_id}`)", "user")
            elif restored.behind:
                self.engine.delete_adapter(model_id)  # restored again by `place`, and replayed onto, before it runs
                self.residency.forget(model_id)
                unavailable[model_id] = Outcome.failed(
                    f"not run: the stored training state of model {model_id} was restored from an older copy "
                    f"(after seq_id {restored.seq}; {'; '.join(restored.problems) or 'the newer one was not found'}) "
                    f"and the requests after it must be replayed onto it first; send the request again", "server")
            else:
                self.residency.paged_in(model_id, time.perf_counter() - started, prefetched=restored.prefetched)
        if not unavailable:
            return cycle, {}
        kept = cycle.keeping(lambda q: q.model_id not in unavailable)
        return kept, {q.id: unavailable[q.model_id] for q in cycle.all() if q.model_id in unavailable}

    def _page_out(self, keep: set[str], incoming: set[str] = frozenset()) -> None:
        """Page out the least recently used runs until the resident ones and `incoming` fit the budget."""
        if not self.residency.limited:
            return
        # a model halfway through a request run in parts holds part of its gradient: it stays
        resident = {m: adapter.resident_bytes for m, adapter in self.engine.adapters.items()}
        victims = self.residency.to_page_out(resident, keep | self.splitting(), incoming)
        for model_id in victims:
            self._evict(model_id, paging=True)  # (this cycle holds the lock, maybe on the compute thread)
        if victims:
            release_freed_host_memory()  # their tensors' pages, not kept for passes (workers/host_memory.py)

    def residency_stats(self) -> ResidencyStats:
        """What is resident and paged out, and the page-ins so far (for operators; from any thread)."""
        adapters = list(self.engine.adapters.items())  # a copy: a cycle may add or drop one meanwhile
        prefetcher = self.live.prefetcher
        return self.residency.stats({m: a.resident_bytes for m, a in adapters},
                                    prefetcher.held_bytes if prefetcher is not None else 0)

    def trainer_memory(self) -> dict[str, ResidencyStats]:
        return {"engine": self.residency_stats()}

    def evict(self, model_id: str) -> None:
        """Write the adapter's full state (gradients included) and drop it from memory."""
        with self._lock:
            run_on(self._compute, lambda: self._evict(model_id), work="trainer")

    def _evict(self, model_id: str, paging: bool = False) -> None:
        """paging: to make room (it comes back here); else it leaves this engine for another."""
        if model_id not in self.engine.adapters:
            if not paging:  # (paged out already) a copy of it read ahead here must not outlive the move
                self.live.forget(model_id)
            return
        if paging:
            self.residency.paged_out(model_id, self.engine.adapters[model_id].resident_bytes)
        else:
            self.residency.forget(model_id)
        last_seq = self._last_seq.pop(model_id, None)
        if last_seq is not None and self.live.captured_seq(model_id) != last_seq:
            # paging out: written in the background (a page-in of the run waits for it), copied there too on
            # CPU (the adapter goes now; on a GPU its memory must go now); moving to another worker: written
            # before it leaves, the next worker loads it
            self.live.persist(model_id, last_seq, with_gradients=True, wait=not paging,
                              handed_over=paging and self.engine.device.type == "cpu")
        elif not paging:
            self.live.writer.flush(model_id)  # captured already: written before it leaves
        if paging:  # idle: one copy on disk is enough (docs/memory.md)
            self.live.keep_one_copy(model_id)
        self.live.forget(model_id)
        self._splits.pop(model_id, None)
        self._last_cycle.pop(model_id, None)  # whoever loads it next ran none of its requests
        self.engine.delete_adapter(model_id)

    # --- cycles ----------------------------------------------------------------------------------

    def run_cycle(self, cycle: Cycle, jobs: dict[str, Job]) -> dict[str, Outcome]:
        with self._lock:
            return run_on(self._compute, lambda: self._run_cycle(cycle, jobs), work="trainer")

    def splitting(self) -> set[str]:
        """The models halfway through a request run in parts here (they must not move or be evicted)."""
        return {model_id for model_id, split in list(self._splits.items()) if not split.complete}

    def _run_cycle(self, cycle: Cycle, jobs: dict[str, Job]) -> dict[str, Outcome]:
        """The cycle in groups of runs that fit the memory budget together, one after another (one group
        under the budget): each run's numbers are the same bits in any grouping (batch invariance)."""
        models = list(dict.fromkeys(q.model_id for q in cycle.all()))
        resident = {m: adapter.resident_bytes for m, adapter in self.engine.adapters.items()}
        outcomes: dict[str, Outcome] = {}
        for group in map(set, self.residency.groups(models, resident)):
            outcomes.update(self._run_group(cycle.keeping(lambda q: q.model_id in group), jobs))
        return outcomes

    def _run_group(self, cycle: Cycle, jobs: dict[str, Job]) -> dict[str, Outcome]:
        for q in cycle.all():  # another request of the model: the one it ran in parts is over (or given up)
            if q.model_id in self._splits and self._splits[q.model_id].request_id != q.id:
                del self._splits[q.model_id]
        cycle, answered = self._answered_before(cycle, jobs)
        cycle, outcomes = self._restore_states(cycle)
        if cycle.forward_backward:
            outcomes.update(self._forward_backward([jobs[r.id] for r in cycle.forward_backward]))
        if cycle.optim_steps:
            outcomes.update(self._optim_steps([jobs[r.id] for r in cycle.optim_steps]))
        for request in cycle.others:
            outcomes[request.id] = self._guarded(self._other, jobs[request.id])
        trained = set()
        for request in cycle.all():  # requests of one model run in seq_id order; a part is not the request
            if request.model_id in self.engine.adapters and outcomes[request.id].progress is None:
                self._last_seq[request.model_id] = max(self._last_seq.get(request.model_id, -1), request.seq_id)
                self.residency.used(request.model_id)
                if request.kind in CHANGES_STATE and not outcomes[request.id].error:
                    trained.add(request.model_id)
        for model_id in trained:  # its durable state follows, at most once per interval (live_state.py)
            self.live.ran(model_id, self._last_seq[model_id])
        self._page_out(keep={q.model_id for q in cycle.all()})  # runs first seen here now have their size
        if self.answer_resent:
            self._remember(cycle, jobs, outcomes, answered)
        outcomes.update(answered)
        return outcomes

    @staticmethod
    def _whole(job: Job) -> bool:
        """A request sent whole (a part is answered from `_splits` instead)."""
        return job.part is None

    def _answered_before(self, cycle: Cycle, jobs: dict[str, Job]) -> tuple[Cycle, dict[str, Outcome]]:
        """The cycle without the requests this engine ran already (a restarted scheduler sent them again),
        and their outcomes, as first given. A model's record is dropped when another request of it comes,
        or when the model is not in memory (it was evicted, or this engine lost it: nothing of it ran here)."""
        if not self.answer_resent:
            return cycle, {}
        answered: dict[str, Outcome] = {}
        for model_id in {q.model_id for q in cycle.all()}:
            record = self._last_cycle.get(model_id)
            if record is None:
                continue
            if model_id not in self.engine.adapters:
                del self._last_cycle[model_id]
                continue
            ids = {q.id for q in cycle.all() if q.model_id == model_id and self._whole(jobs[q.id])}
            if not ids & record.keys():  # the model's next request: its last cycle was committed
                del self._last_cycle[model_id]
                continue
            for request_id in ids & record.keys():
                answered[request_id] = record[request_id]
                log.info("%s: request %s ran here already (sent again after a scheduler restart): answered from "
                         "its outcome", model_id, request_id)
        return cycle.keeping(lambda q: q.id not in answered), answered

    def _remember(self, cycle: Cycle, jobs: dict[str, Job], outcomes: dict[str, Outcome],
                  answered: dict[str, Outcome]) -> None:
        """Keep each model's outcomes of this cycle (those answered from the record included: a scheduler
        killed again sends them again) in place of its previous cycle's. Requests in parts are `_splits`'."""
        ran: dict[str, dict[str, Outcome]] = {}
        for q in cycle.all():
            if self._whole(jobs[q.id]) and q.model_id in self.engine.adapters and outcomes[q.id].progress is None:
                ran.setdefault(q.model_id, {})[q.id] = outcomes[q.id]
        for request_id, outcome in answered.items():
            model_id = jobs[request_id].request.model_id
            ran.setdefault(model_id, {})[request_id] = outcome
        self._last_cycle.update(ran)


    def _forward_backward(self, jobs: list[Job]) -> dict[str, Outcome]:
        """One engine call for every request of the cycle; of a request run in parts, its next part."""
        outcomes: dict[str, Outcome] = {}
        runs: list[tuple[Job, ForwardBackwardInput, SplitRun | None]] = []
        for job in jobs:
            if job.part is None and job.request.model_id not in self._splits:
                runs.append((job, engine_input(job), None))
                continue
            step = self._next_part(job)
            if isinstance(step, Outcome):
                outcomes[job.request.id] = step
            else:
                runs.append((job, step, self._splits[job.request.model_id]))
        if not runs:
            return outcomes
        try:
            results = self.engine.forward_backward([engine_request for _, engine_request, _ in runs])
        except Exception as e:  # a bug or resource failure: every request of the batch fails, clearly
            log.exception("batched forward_backward failed")
            results = [EngineError(f"forward_backward failed: {e}")] * len(runs)
        for (job, engine_request, split), result in zip(runs, results):
            if isinstance(result, EngineError):
                outcomes[job.request.id] = Outcome.failed(str(result), result.category)
                if split is not None:  # the request fails whole; its earlier parts' gradients stay, as a
                    del self._splits[job.request.model_id]  # failed batch's earlier passes' do
            elif split is None:
                outcomes[job.request.id] = self._with_metrics(encoded(result), engine_request, result)
            else:
                split.add(result)
                whole = split.result() if split.complete else None
                outcomes[job.request.id] = (self._with_metrics(encoded(whole), split.prepared.request, whole)
                                            if whole is not None else Outcome(progress=split.progress))
        return outcomes

    def _with_metrics(self, outcome: Outcome, request: ForwardBackwardInput, result: EngineOutput) -> Outcome:
        """A forward_backward's outcome with the dashboard's numbers (forward-only requests train nothing)."""
        if not self.capture_metrics or request.forward_only or request.adapter_id not in self.engine.adapters:
            return outcome
        step = self.engine.adapters[request.adapter_id].step
        return replace(outcome, metrics=forward_backward_metrics(request, result, step))

    def _next_part(self, job: Job) -> ForwardBackwardInput | Outcome:
        """The engine input of a request's next part, or its answer without running anything: a part
        this engine already ran (resent after a scheduler restart: running it again would apply its
        gradient twice), or a failure. A request sent whole that this engine began in parts (the
        scheduler restarted with other settings) runs its remaining datums."""
        model_id = job.request.model_id
        split = self._splits.get(model_id)
        if split is None:
            if job.part.start > 0:
                return Outcome.failed(
                    f"this request's first {job.part.start} datums ran on a trainer engine that has restarted since, "
                    "and their results and gradients went with it; send the request again", "server")
            try:
                split = SplitRun.begin(job.request.id, engine_input(job), self.engine.vocab_size,
                                       self.engine.max_seq_len)
            except InvalidInputError as e:  # the whole request fails before any of it runs
                return Outcome.failed(str(e), e.category)
            self._splits[model_id] = split
        if split.complete:
            return encoded(split.result())
        start = split.done if job.part is None else job.part.start
        if start < split.done:
            return Outcome(progress=split.progress)
        if start > split.done:
            return Outcome.failed(f"part from datum {start} asked, but this engine ran only {split.done} datums of the "
                                  "request", "server")
        max_tokens = math.inf if job.part is None else job.part.max_tokens
        return split.next_input(max_tokens, self.engine.max_pass_tokens, self.engine.min_shared_prefix)

    def _optim_steps(self, jobs: list[Job]) -> dict[str, Outcome]:
        steps = [(job.request.model_id, OptimStepPayload.parse(job.payload).adam_params) for job in jobs]
        outcomes = {}
        for job, result in zip(jobs, self.engine.optim_step(steps)):
            if isinstance(result, EngineError):
                outcomes[job.request.id] = Outcome.failed(str(result), result.category)
                continue
            outcomes[job.request.id] = replace(Outcome.json({"metrics": {f"{k}:mean": v for k, v in result.items()}}),
                                               metrics=optim_step_metrics(result) if self.capture_metrics else None)
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
        """A request that runs alone: dispatched on its kind, its payload parsed by the kind's model."""
        match job.request.kind:
            case RequestKind.CREATE_MODEL:
                return self._create_model(job, CreateModelPayload.parse(job.payload))
            case RequestKind.LOAD_WEIGHTS:
                return self._load_weights(job, LoadWeightsPayload.parse(job.payload))
            case RequestKind.SAVE_WEIGHTS | RequestKind.SAVE_WEIGHTS_FOR_SAMPLER | RequestKind.SAVE_WEIGHTS_EXTERNAL:
                return self._save_weights(job, SaveWeightsPayload.parse(job.payload))
            case RequestKind.REJECTED:  # the scheduler answers these from their recorded error
                raise EngineError("a rejected request runs nothing; its recorded error is its outcome")
        raise EngineError(f"{job.request.kind} is not supported by this server yet")

    def _create_model(self, job: Job, body: CreateModelPayload) -> Outcome:
        model_id = job.request.model_id
        adapter = self.engine.create_adapter(model_id, body.lora_config, body.optimizer)
        stepped = adapter.stepped_bytes
        if self.residency.budget_bytes and stepped > self.residency.budget_bytes:
            self.engine.delete_adapter(model_id)
            raise InvalidInputError("lora_config.rank", (
                f"a rank-{body.lora_config.rank} run of this base model holds {stepped / 2**20:.1f} MiB in training "
                f"(weights, gradients, {body.optimizer}'s state), more than this trainer's memory budget of "
                f"{self.residency.budget_bytes / 2**20:.1f} MiB; use a smaller rank (the operator sets the budget: "
                "LORAPLEX_TRAINER_MEMORY_BUDGET)"))
        self.live.persist(model_id, job.request.seq_id, resets=True, started_by=RequestKind.CREATE_MODEL)
        return Outcome.json({"model_id": model_id, "type": job.request.kind})

    def _load_weights(self, job: Job, body: LoadWeightsPayload) -> Outcome:
        model_id = job.request.model_id
        try:
            self.engine.load_state(model_id, body.storage_path, with_optimizer=body.optimizer,
                                   optimizer=body.optimizer_type)
        except CheckpointError as e:  # named by its tinker:// path: the storage path holds the tenant's id
            raise CheckpointError(f"{body.tinker_path}: {e}") from None
        self.live.persist(model_id, job.request.seq_id, resets=True, started_by=RequestKind.LOAD_WEIGHTS)
        return Outcome.json({"path": body.tinker_path, "model_id": model_id, "type": job.request.kind})

    def _save_weights(self, job: Job, body: SaveWeightsPayload) -> Outcome:
        model_id, kind = job.request.model_id, job.request.kind
        if kind == RequestKind.SAVE_WEIGHTS:
            self.engine.save_state(model_id, body.storage_path)
        elif kind == RequestKind.SAVE_WEIGHTS_EXTERNAL:
            self.engine.save_external_weights(model_id, body.storage_path, body.base_model, body.age_recipients)
        else:
            self.engine.save_sampler_weights(model_id, body.storage_path)
        checkpoint = body.model_dump(include={"kind", "name", "tinker_path", "ttl_seconds", "user_metadata",
                                              "ephemeral"})
        checkpoint.update(storage_path=body.storage_path, size_bytes=store.size(body.storage_path))
        if body.sampling_session_id:  # ephemeral snapshot for save_weights_and_get_sampling_client
            result = {"sampling_session_id": body.sampling_session_id, "type": kind}
        else:
            result = {"path": body.tinker_path, "type": kind}
        if kind == RequestKind.SAVE_WEIGHTS_EXTERNAL:
            result["size_bytes"] = checkpoint["size_bytes"]
        return Outcome.json(result, checkpoint=checkpoint)

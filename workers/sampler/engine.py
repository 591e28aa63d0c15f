"""The sampler engine: one multi-LoRA vLLM engine per base model, driven by its own thread.

Jobs arrive from any thread (`submit`); the engine thread adds them to vLLM and steps it, so
every job in flight, whichever tenant's adapter or the base model, shares each forward pass.
Each adapter snapshot folder becomes one vLLM LoRA (its own id and name: vLLM's prefix cache
never mixes versions), loaded on first use without a restart; vLLM keeps `max_loras` of them
in a batch and evicts the least recently used beyond `max_cpu_loras` (as many as a byte budget holds:
snapshot_budget.py), loading an evicted one again from its folder when a request names it.

A streaming job (`SampleJob.stream`) runs with vLLM's DELTA outputs: each step's new tokens of
each sample go to its progress callback as they are made, and its outcome is those deltas joined,
the same SampleResult as a non-streaming job's. `abort` stops a job (its caller went away).

The engine starts in the background: `submit` queues jobs until it is ready, so the API
answers from the first second. A snapshot on a remote store is downloaded on a thread of its own
while its jobs wait, so one tenant's download never stalls everyone's sampling.
"""

from __future__ import annotations

import itertools
import logging
import os
import queue
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Callable

from loraplex.wire.codec import SampledSequenceWire
import torch
from prometheus_client import Counter, Gauge, Histogram

from contract.errors import EngineError, InvalidInputError
from contract.sampling import SampleDelta, SampleJob, SampleResult, SamplingOptions
from storage import store
from workers.compute_thread import ComputeThread, run_on
from workers.sampler import prompt_rows
from workers.sampler.snapshot_budget import largest_snapshot_bytes, snapshots_in_budget
from workers.sampler.snapshot_check import check_snapshot
from workers.trainer.residency import memory_budget

log = logging.getLogger(__name__)

VLLM_LORA_RANKS = (8, 16, 32, 64, 128, 256, 320, 512)  # the max_lora_rank values vLLM accepts
# (no location in it: a snapshot's storage path holds its tenant's id)
SNAPSHOT_GONE = "the snapshot's weights are gone (the checkpoint was deleted or expired)"
CANCELLED = "sampling cancelled: the caller went away"
Callback = Callable[[str, SampleResult | EngineError], None]
Progress = Callable[[str, list[SampleDelta]], None]  # (request id, this step's new tokens per sample)

# Prometheus metrics (served at GET /metrics; see scheduler/metrics.py)
STEP_SECONDS = Histogram("loraplex_sampler_step_seconds", "Time of one vLLM engine step",
                         buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))
PENDING = Gauge("loraplex_sampler_pending_requests",
                "Sample requests submitted and not finished (the engine's pending: queued or in vLLM)")
GENERATED_TOKENS = Counter("loraplex_sampler_generated_tokens", "Tokens the sampler generated")
FINISHED = Counter("loraplex_sampler_requests_finished", "Sample requests finished by the sampler engine",
                   ["outcome"])


@dataclass(frozen=True)
class SamplerConfig:
    model_path: Path
    max_model_len: int
    max_lora_rank: int = 64
    max_loras: int = 8  # adapters in one batch
    max_cpu_loras: int = 64  # adapters kept loaded (LRU; from_settings sizes it by bytes: snapshot_budget.py)
    dtype: str = "float32"
    kv_cache_gib: float = 1.0
    engine_process: bool = False  # vLLM's engine core in a child process (slower start, own GIL)
    prefix_caching: bool = True
    seed: int = 0
    lora_ops: str = "segmented"  # on CPU: "vllm", vLLM's stock LoRA ops (workers/sampler/vllm_platform.py)

    @classmethod
    def from_settings(cls, settings, info) -> "SamplerConfig":
        """From the service's Settings and the base model's registry entry."""
        return cls(
            model_path=info.path, max_model_len=info.max_context, max_lora_rank=settings.max_lora_rank,
            max_loras=settings.sampler_max_loras, max_cpu_loras=settings.sampler_max_cpu_loras or snapshots_in_budget(
                memory_budget(settings.sampler_memory_budget, settings.sampler_memory_fraction, torch.device("cpu")),
                largest_snapshot_bytes(info.path, settings.max_lora_rank, settings.sampler_dtype),
                settings.sampler_max_loras),
            dtype=settings.sampler_dtype, kv_cache_gib=settings.sampler_kv_cache_gib,
            engine_process=settings.sampler_engine_process, lora_ops=settings.vllm_lora_ops,
        )


def needs_whole_rows(job: SampleJob) -> bool:
    """Whether the job needs the whole next-token distribution at every prompt position (prompt_rows.py)."""
    return job.target_prompt_ids is not None or job.prompt_alt_tokens_k > 0


def vllm_sampling_params(job: SampleJob):
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

    o: SamplingOptions = job.options
    grammar = StructuredOutputsParams(structural_tag=o.structural_tag) if o.structural_tag else None
    whole_rows = needs_whole_rows(job)
    return SamplingParams(
        n=1 if o.temperature == 0 else job.num_samples,  # vLLM refuses n > 1 when greedy: to_result copies
        max_tokens=o.max_tokens, temperature=o.temperature,
        top_k=0 if o.top_k == -1 else o.top_k, top_p=o.top_p, seed=o.seed,
        stop=list(o.stop_strings) or None, stop_token_ids=list(o.stop_token_ids) or None,
        ignore_eos=o.ignore_eos, structured_outputs=grammar,
        logprobs=job.topk_sample_logprobs,  # k >= 0: the sampled token's logprob, plus the top k
        prompt_logprobs=-1 if whole_rows else
        job.topk_prompt_logprobs if job.prompt_logprobs or job.topk_prompt_logprobs else None,
        # the text is never read here (tokens are), and decoding whole-vocabulary rows would cost more
        # than computing them; stop strings need it
        detokenize=not whole_rows or bool(o.stop_strings),
        flat_logprobs=whole_rows,  # arrays, not a Logprob object per value: 6x faster on a 49k vocabulary
        output_kind=RequestOutputKind.DELTA if job.stream else RequestOutputKind.FINAL_ONLY,
    )


def _topk_row(entries, k: int) -> list[tuple[int, float]]:
    ranked = sorted(((lp.rank, tok, lp.logprob) for tok, lp in entries.items() if lp.rank is not None and lp.rank <= k))
    return [(tok, logprob) for _, tok, logprob in ranked[:k]]


@dataclass
class _Joined:
    """A streaming job's DELTA outputs joined into what a FINAL_ONLY output holds (for `to_result`).
    vLLM hands out each of n samples' deltas in outputs of their own, so they are kept by index."""

    outputs: dict[int, object] = field(default_factory=dict)  # index -> CompletionOutput, tokens so far
    num_cached_tokens: int | None = None
    prompt_logprobs: list | None = None

    def add(self, job: SampleJob, output) -> list[SampleDelta]:
        """Join one step's output; its new tokens as deltas (every index when greedy n > 1 shares one)."""
        if self.num_cached_tokens is None:
            self.num_cached_tokens = output.num_cached_tokens
        if output.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = list(output.prompt_logprobs)
        deltas = []
        for completion in output.outputs:
            new_tokens, new_logprobs = list(completion.token_ids), list(completion.logprobs or [])
            joined = self.outputs.get(completion.index)
            if joined is None:
                joined = self.outputs[completion.index] = _Completion(completion.index)
            joined.token_ids.extend(new_tokens)
            joined.logprobs.extend(new_logprobs)
            joined.finish_reason = completion.finish_reason
            if not new_tokens:
                continue
            k = job.topk_sample_logprobs
            delta = SampleDelta(
                completion.index, tuple(new_tokens),
                tuple(row[t].logprob for row, t in zip(new_logprobs, new_tokens)),
                tuple(tuple(_topk_row(row, k)) for row in new_logprobs) if k else None)
            if job.options.temperature == 0:  # greedy: vLLM makes one sequence, every sample is a copy
                deltas.extend(SampleDelta(i, delta.tokens, delta.logprobs, delta.topk_logprobs)
                              for i in range(job.num_samples))
            else:
                deltas.append(delta)
        return deltas


@dataclass
class _Completion:
    index: int
    token_ids: list = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    finish_reason: str | None = None


def to_result(job: SampleJob, output) -> SampleResult:
    """A vLLM RequestOutput as the Tinker SampleResponse needs it."""
    sequences = []
    for completion in sorted(output.outputs, key=lambda c: c.index):
        tokens = list(completion.token_ids)
        per_position = completion.logprobs or []
        sequences.append(SampledSequenceWire(
            tokens=tokens,
            logprobs=[per_position[i][t].logprob for i, t in enumerate(tokens)],
            stop_reason="length" if completion.finish_reason == "length" else "stop",
            topk_logprobs=[_topk_row(p, job.topk_sample_logprobs) for p in per_position]
            if job.topk_sample_logprobs else None,
        ))
    if len(sequences) < job.num_samples:  # greedy: every sample is the same sequence
        sequences = sequences * job.num_samples
    result = SampleResult(sequences, prompt_cache_hit_tokens=output.num_cached_tokens or 0,
                          topk=max(job.topk_sample_logprobs, job.topk_prompt_logprobs) or None)
    if output.prompt_logprobs is not None and needs_whole_rows(job):
        _whole_row_fields(job, result, prompt_rows.full_rows(output.prompt_logprobs))
    elif output.prompt_logprobs is not None:
        rows = list(output.prompt_logprobs)
        if job.prompt_logprobs:
            result.prompt_logprobs = [None if row is None else row[t].logprob for row, t in zip(rows, job.prompt)]
        if job.topk_prompt_logprobs:
            result.topk_prompt_logprobs = [None if row is None else _topk_row(row, job.topk_prompt_logprobs) for row in rows]
        result.mask_prompt_logprobs(job.prompt_logprobs_last_n)
    return result


def _whole_row_fields(job: SampleJob, result: SampleResult, full) -> None:
    """Every prompt field a job asked for, read off the whole distribution at each position (prompt_rows.py)."""
    if job.prompt_logprobs:
        result.prompt_logprobs = prompt_rows.prompt_token_logprobs(full, job.prompt)
    if job.topk_prompt_logprobs:
        result.topk_prompt_logprobs = prompt_rows.topk_rows(full, job.topk_prompt_logprobs)
    result.mask_prompt_logprobs(job.prompt_logprobs_last_n)
    if job.target_prompt_ids is not None:
        result.target_prompt_logprobs = prompt_rows.target_logprobs(full, job.target_prompt_ids)
        result.target_prompt_csr = job.target_prompt_csr
    if job.prompt_alt_tokens_k:
        result.prompt_alt_tokens = prompt_rows.alt_draws(full, job.prompt_alt_tokens_k, job.options.temperature,
                                                         job.options.seed)


class SamplerEngine:
    streams = True  # reports a streaming job's tokens as it makes them (SamplingDispatcher.streams)

    def __init__(self, config: SamplerConfig, compute: ComputeThread | None = None) -> None:
        """compute: where vLLM's torch work runs (its build, adapter loads and steps), when the
        process shares one compute thread between engines (workers/compute_thread.py); else on
        the engine thread itself."""
        self.config = config
        self._compute = compute
        self.ready = threading.Event()
        self.failed: BaseException | None = None
        self._inbox: queue.SimpleQueue[tuple[SampleJob, Callback]] = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._stop = threading.Event()
        self._callbacks: dict[str, tuple[SampleJob, Callback]] = {}
        self._pending = 0  # submitted and not yet finished
        PENDING.set_function(lambda: self._pending)  # vLLM allows one engine per process: this one
        self._pending_lock = threading.Lock()
        self._loras: dict = {}  # snapshot location -> its vLLM LoRARequest (the local folder vLLM loaded)
        # remote snapshots: downloads in flight (location -> jobs waiting for it), finished ones
        self._downloads = ThreadPoolExecutor(max_workers=2, thread_name_prefix="snapshot-download")
        self._downloading: dict[str, list[tuple[SampleJob, Callback]]] = {}
        self._downloaded: queue.SimpleQueue[tuple[str, Path | None | Exception]] = queue.SimpleQueue()
        self._folders: dict[str, Path] = {}  # remote location -> its local copy
        self._next_lora_id = itertools.count(1)  # never reused: vLLM keys loaded adapters by id
        self._engine = None
        self._unrun_failures: list[tuple[str, EngineError]] = []  # jobs failed while draining, to finish
        self._progress: dict[str, Progress] = {}  # streaming jobs' progress callbacks (set by `submit`)
        self._joined: dict[str, _Joined] = {}  # streaming jobs in vLLM: their outputs so far
        self._aborts: queue.SimpleQueue[str] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="sampler-engine", daemon=True)

    # --- lifecycle -----------------------------------------------------------------------------

    def start(self) -> "SamplerEngine":
        self._thread.start()
        return self

    def wait_ready(self, timeout: float | None = None) -> None:
        if not self.ready.wait(timeout):
            raise TimeoutError("the sampler engine did not start in time")
        if self.failed is not None:
            raise RuntimeError(f"the sampler engine failed to start: {self.failed}")

    def close(self) -> None:
        """Stop the engine thread and shut vLLM down. vLLM keeps process-wide state (its
        distributed groups): one engine per process at a time, closed before the next starts."""
        self._stop.set()
        self._wakeup.set()
        self._downloads.shutdown(wait=False, cancel_futures=True)
        self._thread.join(timeout=30)
        if self._engine is not None:
            self._engine.engine_core.shutdown()
            self._engine = None

    def _build(self):
        from vllm import EngineArgs
        from vllm.v1.engine.llm_engine import LLMEngine

        from workers.sampler.vllm_platform import LORA_OPS_VARIABLE

        c = self.config
        rank = next(r for r in VLLM_LORA_RANKS if r >= c.max_lora_rank)
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if c.engine_process else "0"
        os.environ[LORA_OPS_VARIABLE] = c.lora_ops  # for our platform plugin (vllm_platform.py)
        args = EngineArgs(
            model=str(c.model_path), dtype=c.dtype, seed=c.seed, max_model_len=c.max_model_len,
            kv_cache_memory_bytes=int(c.kv_cache_gib * 2**30), enable_lora=True, max_loras=c.max_loras, max_lora_rank=rank, max_cpu_loras=c.max_cpu_loras,
            # prefix caching for GRPO groups (n samples of one prompt) and multi-turn prompts; block
            # 32 because with the CPU default of 128 prompts under 128 tokens never hit the cache
            enable_prefix_caching=c.prefix_caching, block_size=32,
            # no chunked prefill: on CPU, a seeded request whose prompt is split over two steps
            # fails the whole step ("CPU Generator does not use offset" when vLLM rewinds its
            # generator); a whole prompt per step avoids the rewind
            enable_chunked_prefill=False, max_num_batched_tokens=max(c.max_model_len, 2048),
            max_logprobs=-1,  # whole-vocabulary prompt rows (prompt_rows.py); the API caps the rest at 20
            distributed_executor_backend="uni", disable_log_stats=True,
        )
        return LLMEngine.from_engine_args(args)

    # --- jobs ----------------------------------------------------------------------------------

    @property
    def pending(self) -> int:
        """Jobs submitted and not finished yet (the caller's measure of load, for backpressure)."""
        return self._pending

    def submit(self, job: SampleJob, on_done: Callback, on_progress: Progress | None = None) -> None:
        """Queue a job; `on_done(request_id, result or error)` is called from the engine thread, and for
        a streaming job `on_progress(request_id, deltas)` after each step that made tokens, before it."""
        if self.failed is not None:
            raise RuntimeError(f"the sampler engine failed to start: {self.failed}")
        with self._pending_lock:
            self._pending += 1
        if job.stream and on_progress is not None:
            self._progress[job.request_id] = on_progress
        self._inbox.put((job, on_done))
        self._wakeup.set()

    def abort(self, request_id: str) -> None:
        """Stop a job (from any thread): it fails with CANCELLED; nothing happens if it already finished."""
        self._aborts.put(request_id)
        self._wakeup.set()

    def _finish(self, request_id: str, outcome: SampleResult | EngineError) -> None:
        job, on_done = self._callbacks.pop(request_id)
        self._progress.pop(request_id, None)
        self._joined.pop(request_id, None)
        with self._pending_lock:
            self._pending -= 1
        FINISHED.labels("ok" if isinstance(outcome, SampleResult) else "failed").inc()
        try:
            on_done(request_id, outcome)
        except Exception:
            log.exception("sample callback failed for %s", request_id)

    def _lora_request(self, location: str):
        """The vLLM LoRA of a snapshot (a store location, storage/store.py), loaded on first use
        from a local folder (a remote store's snapshot is downloaded once)."""
        from vllm.lora.request import LoRARequest

        if location in self._loras:
            return self._loras[location]
        folder = self._folders.get(location) or store.local_folder(location)
        if folder is None:
            raise InvalidInputError("sampling_session_id", SNAPSHOT_GONE)
        check_snapshot(Path(folder))  # its files match their manifest, its weights are finite
        lora_id = next(self._next_lora_id)
        request = LoRARequest(f"snapshot-{lora_id}", lora_id, str(folder))
        self._engine.add_lora(request)  # load now: a broken folder fails this job, not the batch
        self._loras[location] = request
        return request

    def _needs_download(self, location: str | None) -> bool:
        return bool(location) and store.is_remote(location) and location not in self._loras \
            and location not in self._folders

    def _download(self, location: str) -> None:
        """On a download thread: fetch a remote snapshot, then hand it to the engine thread."""
        try:
            result = store.local_folder(location)
        except Exception as e:
            log.warning("downloading snapshot %s failed: %s", location, e)
            result = e
        self._downloaded.put((location, result))
        self._wakeup.set()

    def _resume_downloaded(self) -> None:
        """Jobs whose snapshot download finished: add them, or fail them if it did not arrive."""
        while True:
            try:
                location, result = self._downloaded.get_nowait()
            except queue.Empty:
                return
            if isinstance(result, Path):
                self._folders[location] = result
            for job, on_done in self._downloading.pop(location, []):
                if result is None:
                    self._fail_unrun(job.request_id, InvalidInputError("sampling_session_id", SNAPSHOT_GONE))
                elif isinstance(result, Exception):
                    self._fail_unrun(job.request_id, EngineError(  # (its text may name the store location)
                        f"sampling failed: downloading the snapshot failed ({type(result).__name__})"))
                else:
                    self._add(job, on_done)

    def _add(self, job: SampleJob, on_done: Callback) -> None:
        self._callbacks[job.request_id] = (job, on_done)
        if self._needs_download(job.adapter_path):
            waiting = self._downloading.get(job.adapter_path)
            if waiting is None:
                waiting = self._downloading[job.adapter_path] = []
                self._downloads.submit(self._download, job.adapter_path)
            waiting.append((job, on_done))
            return
        try:
            lora = self._lora_request(job.adapter_path) if job.adapter_path else None
            if job.stream:
                self._joined[job.request_id] = _Joined()
            self._engine.add_request(job.request_id, {"prompt_token_ids": list(job.prompt)},
                                     vllm_sampling_params(job), lora_request=lora)
        except EngineError as e:
            self._fail_unrun(job.request_id, e)
        except Exception as e:  # vLLM rejected the request or the adapter: this job fails alone
            log.warning("sample %s rejected: %s", job.request_id, e)
            self._loras.pop(job.adapter_path or "", None)
            self._fail_unrun(job.request_id, EngineError(f"sampling failed: {e}"))

    def _fail_unrun(self, request_id: str, error: EngineError) -> None:
        """A job that failed before vLLM ran it; its callback is called on the engine thread (it
        stores the outcome: no database work on a compute thread)."""
        self._unrun_failures.append((request_id, error))

    def _run(self) -> None:
        try:
            self._engine = run_on(self._compute, self._build, work="sampler")
        except BaseException as e:  # reported to every waiting and later job
            log.exception("the sampler engine failed to start")
            self.failed = e
            self.ready.set()
            self._fail_queued(f"the sampler engine failed to start: {e}")
            return
        self.ready.set()
        while not self._stop.is_set():
            has_work = run_on(self._compute, self._drain, work="sampler", interleave=True)
            failures, self._unrun_failures = self._unrun_failures, []
            for request_id, error in failures:
                self._finish(request_id, error)
            if not has_work:
                self._wakeup.wait(timeout=0.5)
                self._wakeup.clear()
                continue
            try:
                outputs = run_on(self._compute, self._step, work="sampler", interleave=True)
            except Exception as e:  # an engine failure fails what was in flight, clearly
                log.exception("sampler step failed")
                for request_id in list(self._callbacks):
                    self._engine.abort_request([request_id])
                    self._finish(request_id, EngineError(f"sampling failed: {e}"))
                continue
            for output in outputs:
                if output.request_id not in self._callbacks:
                    continue
                job, _ = self._callbacks[output.request_id]
                try:
                    if job.stream:
                        output = self._joined_output(job, output)
                    if not output.finished:
                        continue
                    GENERATED_TOKENS.inc(sum(len(c.token_ids) for c in output.outputs))
                    outcome = to_result(job, output)
                except Exception as e:  # a bug here must not stop the engine thread
                    log.exception("converting the output of %s failed", output.request_id)
                    self._engine.abort_request([output.request_id])
                    outcome = EngineError(f"sampling failed: {e}")
                self._finish(output.request_id, outcome)

    def _joined_output(self, job: SampleJob, output):
        """A streaming job's step: its new tokens to the progress callback; the joined output so far."""
        joined = self._joined[job.request_id]
        deltas = joined.add(job, output)
        progress = self._progress.get(job.request_id)
        if deltas and progress is not None:
            try:
                progress(job.request_id, deltas)
            except Exception:  # a listener's failure never stops the sample
                log.exception("progress callback failed for %s", job.request_id)
        return SimpleNamespace(request_id=output.request_id, finished=output.finished,
                               outputs=list(joined.outputs.values()), num_cached_tokens=joined.num_cached_tokens,
                               prompt_logprobs=joined.prompt_logprobs)

    def _abort_requested(self) -> None:
        """Jobs whose caller went away: out of vLLM (or of a download's wait list), failed as cancelled."""
        while True:
            try:
                request_id = self._aborts.get_nowait()
            except queue.Empty:
                return
            if request_id not in self._callbacks or any(rid == request_id for rid, _ in self._unrun_failures):
                continue  # finished already, or failing anyway
            self._engine.abort_request([request_id])
            for waiting in self._downloading.values():
                waiting[:] = [(job, cb) for job, cb in waiting if job.request_id != request_id]
            self._fail_unrun(request_id, EngineError(CANCELLED))

    def _step(self):
        with STEP_SECONDS.time():
            return self._engine.step()

    def _drain(self) -> bool:
        """Hand the arrived jobs to vLLM; whether it has work to step."""
        self._resume_downloaded()
        while True:
            try:
                job, on_done = self._inbox.get_nowait()
            except queue.Empty:
                self._abort_requested()
                return self._engine.has_unfinished_requests()
            self._add(job, on_done)

    def _fail_queued(self, message: str) -> None:
        while True:
            try:
                job, on_done = self._inbox.get_nowait()
            except queue.Empty:
                return
            self._callbacks[job.request_id] = (job, on_done)
            self._finish(job.request_id, EngineError(message))

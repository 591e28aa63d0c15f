"""All settings in one place, from environment variables (LORAPLEX_*) or flags."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from workers import store


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="LORAPLEX_")

    data_dir: Path = Path("data")
    # Checkpoints, sampler snapshots and adapter state: a path or an fsspec URL every process
    # reaches (workers/store.py; e.g. s3://bucket/loraplex with FSSPEC_S3_* options). Empty: data_dir.
    store_url: str = ""
    database_url: str = ""  # empty: SQLite under data_dir
    base_model: str = "tiny"  # a registry name (see workers/models/registry.py) or a local HF folder
    host: str = "127.0.0.1"
    port: int = 8000

    max_lora_rank: int = 64
    max_resident_adapters: int = Field(0, description="adapters a trainer keeps in memory (0: no limit); "
                                       "the least recently used are written to the data dir and reloaded on use")
    # Embedded mode is one process with an in-process executor. True moves the trainer engine into
    # a child process (its own GIL), so the API stays responsive while it computes.
    engine_process: bool = False
    # Embedded mode: the trainer's cycles and the sampler's steps take turns on one thread, so libgomp
    # manages one OpenMP team and does not throttle (workers/compute_thread.py). False: each on a
    # thread of its own, overlapping (for machines with cores to spare for both). None: on where
    # there is no CUDA device (on a GPU the two engines' kernels may overlap; not measured there).
    compute_thread: bool | None = None
    state_write_interval_seconds: float = Field(
        5.0, description="an adapter's durable training state is written at most this often; a crash "
        "replays up to this long of its steps from the database (scheduler/live_state.py)")
    cycle_token_budget: int = Field(8192, description="tokens per batched engine call (one scheduler cycle)")
    tenant_max_tokens_in_flight: int = Field(
        0, ge=0, description="a tenant's new forward/forward_backward requests wait in the queue while its "
        "requests started and not yet run (the rest of those run in parts, and this cycle's) would exceed this "
        "many tokens; one larger request still runs, alone for its tenant (0: no limit; scheduler/planner.py)")
    # 0: no added latency; under load, requests arriving during a cycle form the next one anyway
    cycle_gather_seconds: float = Field(0.0, description="an idle scheduler waits this long for co-arriving requests")
    max_request_bytes: int = 64 * 1024 * 1024
    # workers.trainer.shared_prefix.MIN_SHARED_TOKENS, written out: this module must not import torch
    # (the embedded server sets OpenMP's spin settings before torch loads; service/openmp.py)
    trainer_min_shared_prefix: int = Field(8, description="datums of one request that begin with "
                                           "at least this many equal tokens (an RL group's prompt) compute them once "
                                           "(0: never; workers/trainer/shared_prefix.py)")
    seq_gap_seconds: float = Field(60.0, description="a model's missing seq_id is skipped (recorded as failed) "
                                   "once a later one has waited this long behind it")
    ephemeral_snapshot_grace_seconds: float = Field(
        600.0, description="an unnamed sampler snapshot (save_weights_and_get_sampling_client) is deleted once a "
        "newer one of its model exists and nothing sampled it for this long (scheduler/janitor.py)")

    # Distributed trainer workers: "local" runs cycles in this process (or its child, with
    # engine_process); "celery" sends them to Celery trainer workers (workers/celery_worker.py).
    executor: Literal["local", "celery"] = "local"
    redis_url: str = "redis://127.0.0.1:6379/0"

    # The sampler: a multi-LoRA vLLM engine beside the trainer (needs the sampler-cpu/-gpu extra).
    sampler_enabled: bool = True
    sampler_max_loras: int = Field(8, description="adapters sampled together in one batch")
    sampler_max_cpu_loras: int = Field(64, description="adapter snapshots kept loaded (least recently used evicted)")
    sampler_dtype: str = "float32"  # the trainer's dtype: sampler and trainer logprobs agree closely
    sampler_kv_cache_gib: float = 1.0
    sampler_max_pending: int = Field(256, description="samples in flight before asample answers 429")
    sampler_max_samples: int = Field(128, description="num_samples limit of one request")
    sampler_engine_process: bool = False  # vLLM's engine core in a child process (slower start)
    metrics_port: int = Field(0, description="the scheduler and sampler worker processes serve their Prometheus "
                              "metrics on this port (0: not served; the API process serves GET /metrics)")
    long_poll_seconds: float = 30.0  # retrieve_future holds the request this long before try_again

    @property
    def resolved_database_url(self) -> str:
        return self.database_url or f"sqlite:///{(self.data_dir / 'loraplex.db').resolve()}"

    @property
    def store_root(self) -> str:
        return self.store_url or str(self.data_dir)

    @property
    def checkpoint_dir(self) -> str:
        """Where users' checkpoints go (a store location)."""
        return store.join(self.store_root, "checkpoints")

    @property
    def live_dir(self) -> str:
        """Where each adapter's durable training state goes (a store location)."""
        return store.join(self.store_root, "live")

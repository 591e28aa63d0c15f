"""All settings in one place, from environment variables (LORAPLEX_*) or flags.

Each process reads them once, when it starts (`python -m service ...`, the Celery workers,
`loraplex-admin`), and passes them to the code that uses them; no library module reads the
environment. docs/settings.md is generated from this class: `.venv/bin/python scripts/settings_table.py --write`.

This module must not import torch: `serve` reads the settings before torch loads, since libgomp
takes OpenMP's spin settings only then (service/openmp.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import ByteSize, Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict

from models import registry
from storage import store


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="LORAPLEX_")

    # --- where things are -------------------------------------------------------------------------
    data_dir: Path = Field(Path("data"), description="the SQLite database (unless database_url), checkpoints and "
                           "adapter state; in distributed mode a folder every machine mounts (flag --data-dir)")
    store_url: str = Field("", description="checkpoints, sampler snapshots and adapter state: a path or an fsspec URL "
                           "every process reaches, e.g. s3://bucket/loraplex with FSSPEC_S3_* options "
                           "(storage/store.py; empty: data_dir)")
    store_cache: str = Field("", description="where the folders of a remote store_url are downloaded, once per version "
                             "(empty: loraplex-store-cache in the system's temp dir)")
    database_url: str = Field("", description="SQLAlchemy URL, e.g. postgresql+psycopg://... (empty: SQLite under data_dir)")
    base_model: str = Field("tiny", description="the base model served: a registered model's hub id or short "
                            "name (tiny, SmolLM2-135M-Instruct; models/registry.py), a local Hugging Face folder, or "
                            "any hub id in the local Hugging Face cache (downloaded first where the hub is reachable); "
                            "several, comma-separated, are served side by side (flag --base-model, repeatable; "
                            "docs/models.md)")
    model_name: str = Field("", description="the hub id a folder base_model is advertised under, e.g. "
                            "Qwen/Qwen3-0.6B, so clients load its tokenizer by that id (empty: the folder's path); "
                            "with several base models, comma-separated in the same order, empty for those not folders "
                            "(flag --model-name)")
    model_cache: Path = Field(registry.DEFAULT_CACHE_DIR, description="where registered base models are built or "
                              "converted, once (models/registry.py)")
    host: str = Field("127.0.0.1", description="the API's address (flag --host)")
    port: int = Field(8000, description="the API's port (flag --port)")

    # --- training ---------------------------------------------------------------------------------
    max_lora_rank: int = Field(64, description="the largest LoRA rank a training run may ask for (the sampler's vLLM "
                               "engine is sized for it)")
    trainer_memory_budget: ByteSize | None = Field(
        None, description="bytes of training state (adapters, gradients, AdamW moments) a trainer keeps in memory, "
        "e.g. 8GiB; the least recently used runs are paged out to the store and back in on use, bitwise "
        "(unset: trainer_memory_fraction of the device's memory; docs/memory.md)")
    trainer_memory_fraction: float = Field(
        0.4, ge=0, le=1, description="unless trainer_memory_budget is set: the budget as a fraction of the memory "
        "adapters live in (the GPU's; the machine's RAM on CPU) (0: no limit)")
    trainer_prefetch_bytes: ByteSize | None = Field(
        None, description="bytes of paged-out runs' state a trainer reads back ahead of the cycle that needs them "
        "(the scheduler's queued requests say which), held beside the memory budget (unset: a quarter of the budget; "
        "0: off; docs/memory.md)")
    max_resident_adapters: int = Field(0, description="besides the byte budget, at most this many runs in a "
                                       "trainer's memory (0: no limit)")
    engine_process: bool = Field(False, description="embedded mode: the trainer engine in a child process (its own GIL), "
                                 "so the API stays responsive while it computes")
    compute_thread: bool | None = Field(
        None, description="embedded mode: the trainer's cycles and the sampler's steps take turns on one thread, so "
        "libgomp manages one OpenMP team and does not throttle (workers/compute_thread.py); false: each on a thread of "
        "its own, overlapping (for machines with cores to spare for both); unset: on where there is no CUDA device or "
        "several base models are served (their vLLM engines must take turns)")
    state_write_interval_seconds: float = Field(
        5.0, description="an adapter's durable training state is written at most this often; a crash "
        "replays up to this long of its work from the database (workers/trainer/live_state.py)")
    # workers.trainer.shared_prefix.MIN_SHARED_TOKENS, written out: this module must not import torch
    trainer_min_shared_prefix: int = Field(8, description="datums of one request that begin with "
                                           "at least this many equal tokens (an RL group's prompt) compute them once "
                                           "(0: never; workers/trainer/shared_prefix.py)")

    # --- scheduling -------------------------------------------------------------------------------
    cycle_token_budget: int = Field(8192, description="tokens per batched engine call (one scheduler cycle)")
    tenant_max_tokens_in_flight: int = Field(
        0, ge=0, description="a tenant's new forward/forward_backward requests wait in the queue while its "
        "requests started and not yet run (the rest of those run in parts, and this cycle's) would exceed this "
        "many tokens; one larger request still runs, alone for its tenant (0: no limit; scheduler/planner.py)")
    cycle_gather_seconds: float = Field(0.0, description="an idle scheduler waits this long for co-arriving requests "
                                        "(0: no added latency; under load, requests arriving during a cycle form the "
                                        "next one anyway)")
    seq_gap_seconds: float = Field(60.0, description="a model's missing seq_id is skipped (recorded as failed) "
                                   "once a later one has waited this long behind it")
    ephemeral_snapshot_grace_seconds: float = Field(
        600.0, description="an unnamed sampler snapshot (save_weights_and_get_sampling_client) is deleted once a "
        "newer one of its model exists and nothing sampled it for this long (scheduler/janitor.py)")

    # --- the API ----------------------------------------------------------------------------------
    max_request_bytes: int = Field(64 * 1024 * 1024, description="a request body's limit, also once decompressed; "
                                   "larger ones get 413 (api/request_guard.py)")
    long_poll_seconds: float = Field(30.0, description="retrieve_future holds a request this long before it answers "
                                     "try_again")
    download_url_key: str = Field(
        "", description="the secret key that signs download URLs of external weights (HMAC-SHA256); every API "
        "replica needs the same one (empty: a random key, made once and kept in data_dir/download_url.key; "
        "api/download_urls.py)")
    download_url_seconds: int = Field(3600, ge=60, le=7 * 86400, description="how long a signed download URL of "
                                      "external weights stays valid (get_external_weights_urls)")
    metrics_port: int = Field(0, description="the scheduler, sampler and trainer worker processes serve their Prometheus "
                              "metrics on this port (0: not served; the API process serves GET /metrics)")
    jwt_auth: bool = Field(True, description="offer the Tinker SDK's token exchange (POST /api/v1/auth/token): the SDK "
                           "swaps its API key for a short-lived signed token, which whoami reads; plain API keys are "
                           "accepted either way (api/auth_tokens.py)")
    jwt_signing_key: SecretStr = Field(SecretStr(""), description="the secret the exchange's tokens are signed with "
                                       "(HS256; at least 32 bytes); every API replica needs the same one (empty: "
                                       "generated once and kept in data_dir/jwt_signing_key)")
    jwt_lifetime_seconds: int = Field(900, ge=300, le=86400, description="how long an exchanged token is valid; the SDK "
                                      "exchanges again at about half of it")

    # --- distributed mode -------------------------------------------------------------------------
    executor: Literal["local", "celery"] = Field(
        "local", description="where trainer cycles run: local, in this process (or its child, with engine_process); "
        "celery, on Celery trainer workers (service/celery_worker.py)")
    redis_url: str = Field("redis://127.0.0.1:6379/0", description="Redis: the Celery broker, the request inbox and "
                           "the workers' registrations (distributed mode, or executor=celery)")
    worker_id: str = Field("", description="a Celery trainer or sampler worker's id, under which it registers "
                           "(empty: its Celery node name); docker-compose.yml names each worker's queue after it")

    # --- the sampler: a multi-LoRA vLLM engine beside the trainer ------------------------------------
    sampler_enabled: bool = Field(True, description="serve sample requests (needs the sampler-cpu or sampler-gpu extra)")
    sampler_max_loras: int = Field(8, description="adapters sampled together in one batch")
    sampler_max_cpu_loras: int | None = Field(
        None, description="adapter snapshots kept loaded, least recently used evicted and loaded again on use "
        "(unset: as many of the largest snapshot, every layer at max_lora_rank, as the sampler's memory budget holds)")
    sampler_memory_budget: ByteSize | None = Field(
        None, description="bytes of adapter snapshots the sampler keeps loaded, e.g. 2GiB (unset: "
        "sampler_memory_fraction of the machine's RAM; docs/memory.md)")
    sampler_memory_fraction: float = Field(
        0.1, ge=0, le=1, description="unless sampler_memory_budget is set: its budget as a fraction of the machine's RAM")
    sampler_dtype: str = Field("float32", description="the sampler's dtype; the trainer's keeps sampler and trainer "
                               "logprobs close")
    sampler_kv_cache_gib: float = Field(1.0, description="vLLM's KV cache, in GiB")
    sampler_max_pending: int = Field(256, description="samples in flight before asample answers 429")
    sampler_max_samples: int = Field(128, description="num_samples limit of one request")
    sampler_engine_process: bool = Field(False, description="vLLM's engine core in a child process (its own GIL; "
                                         "~17 s start instead of ~3 s)")
    vllm_lora_ops: Literal["segmented", "vllm"] = Field(
        "segmented", description="the CPU sampler's LoRA ops: Loraplex's segmented ops, or vLLM's stock ones (for "
        "comparisons only: they leak an adapter into base-model rows of a mixed batch; workers/sampler/vllm_platform.py)")

    # --- the process ---------------------------------------------------------------------------------
    keep_openmp_defaults: bool = Field(
        False, description="python -m service serve leaves libgomp's settings alone instead of setting "
        "OMP_WAIT_POLICY=ACTIVE and GOMP_SPINCOUNT before torch loads (service/openmp.py)")
    keep_glibc_malloc_defaults: bool = Field(
        False, description="the trainer leaves glibc malloc's settings alone instead of keeping freed host memory "
        "in the process (workers/host_memory.py)")

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

    @property
    def base_models(self) -> list[tuple[str, str | None]]:
        """(base_model, the name a folder is advertised under or None) of each model served, in order."""
        sources = [part.strip() for part in self.base_model.split(",")]
        names = [part.strip() for part in self.model_name.split(",")] if self.model_name else []
        if len(names) > len(sources):
            raise registry.ModelUnavailable(f"model_name: {len(names)} names for {len(sources)} base models")
        if not all(sources):
            raise registry.ModelUnavailable(f"base_model: {self.base_model!r} has an empty entry")
        return [(source, names[i] if i < len(names) and names[i] else None) for i, source in enumerate(sources)]

    def served_models(self) -> list[registry.ModelInfo]:
        """The base models these settings serve, the first the default; registry.ModelUnavailable (its
        message names why) if one cannot be, or two are the same model."""
        infos = [registry.model_info(source, self.model_cache, name) for source, name in self.base_models]
        names = [info.name for info in infos]
        if len(set(names)) < len(names):
            raise registry.ModelUnavailable(f"base_model: {self.base_model!r} names a model twice ({', '.join(names)})")
        return infos

    def served_model(self) -> registry.ModelInfo:
        """The one base model of a process that serves one (a scheduler, a Celery worker); ModelUnavailable
        otherwise."""
        if len(self.base_models) > 1:
            raise registry.ModelUnavailable(f"base_model: a scheduler or worker serves one base model, not "
                                            f"{self.base_model!r}; start one per base model")
        return self.served_models()[0]

    def model_source(self, name: str) -> str:
        """Where a run's base model `name` (as stored with the run) loads from: the folder this deployment
        advertises under that hub id, else the name itself."""
        return next((source for source, advertised in self.base_models if advertised == name), name)

"""Every name the processes of a distributed deployment meet under in Redis and Celery: task names,
keys, lists and pub/sub channels. Plain strings, no Redis client: the API replicas, the scheduler and
the workers import the same definitions (messaging/ holds the code that reads and writes them)."""

from __future__ import annotations

import uuid

# --- Celery task names ---------------------------------------------------------------------------
TASK = "loraplex.run_cycle"  # trainer workers: run one cycle stored in Redis
EVICT_TASK = "loraplex.evict"  # trainer workers: write adapters' full state to the store, drop them
SAMPLE_TASK = "loraplex.sample"  # sampler workers: start one sample job stored in Redis

RESULT_TTL_SECONDS = 3600  # cycles, sample jobs and outcomes left in Redis by a crash expire

# --- registrations (heartbeats: messaging/celery_app.py) ----------------------------------------
# A set of the registration keys in use: finding the live workers reads these few keys instead of
# SCANning every key in Redis (outcomes and cycles are keys too: a scan grew with the traffic).
REGISTRY = "loraplex:registrations"


def worker_key(worker_id: str) -> str:
    """A trainer worker's registration: base model, queues, resident adapters; expires without heartbeats."""
    return f"loraplex:worker:{worker_id}"


def sampler_key(worker_id: str) -> str:
    """A sampler worker's registration: base model, queues, samples in flight."""
    return f"loraplex:sampler:{worker_id}"


def scheduler_key(base_model: str) -> str:
    """The scheduler's heartbeat (one scheduler per base model)."""
    return f"loraplex:scheduler:{base_model}"


# --- API replicas <-> scheduler (messaging/bus.py) ----------------------------------------------
FINISHED = "loraplex:finished"  # pub/sub: the id of each finished request, to every API replica


def inbox_key(base_model: str) -> str:
    """A list: the requests API replicas accepted for `base_model`, for its scheduler."""
    return f"loraplex:inbox:{base_model}"


# --- scheduler <-> trainer workers (scheduler/celery_executor.py) -------------------------------
PLACEMENT = "loraplex:placement"  # hash: model id -> the worker id that holds its adapter


def cycle_key() -> str:
    """A new cycle's key; its outcomes go to `<key>:outcomes`, and `<key>:done` (a list) wakes the
    scheduler's wait for them."""
    return f"loraplex:cycle:{uuid.uuid4().hex}"


def cycle_outcomes_key(cycle: str) -> str:
    return f"{cycle}:outcomes"


def cycle_done_key(cycle: str) -> str:
    return f"{cycle}:done"


# --- scheduler <-> sampler workers (scheduler/remote_sampler.py) --------------------------------
def sample_job_key(request_id: str, attempt: int) -> str:
    """One dispatch of a sample job (a resend after a worker died is a new attempt, a new key)."""
    return f"loraplex:sample-job:{request_id}:{attempt}"


def sample_done_key(base_model: str) -> str:
    """A list: the sampler workers of `base_model` push each finished request id here."""
    return f"loraplex:sample-done:{base_model}"


def sample_outcome_key(request_id: str) -> str:
    return f"loraplex:sample-outcome:{request_id}"


# --- sampler workers -> API replicas: streamed tokens (messaging/stream_channels.py) ------------
def replica_channel() -> str:
    """A new API replica's channel for the streams it follows."""
    return f"loraplex:sample-stream:{uuid.uuid4().hex}"


def abort_channel(base_model: str) -> str:
    """Pub/sub: ids of streamed jobs whose caller went away; the worker running one stops it."""
    return f"loraplex:sample-abort:{base_model}"

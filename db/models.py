"""The service's tables as SQLAlchemy 2 models, portable across SQLite (embedded) and Postgres.

Portability rules: generic types only (JSON, LargeBinary, String), string primary keys, enums
stored as plain strings (no native Postgres ENUM to migrate), explicit constraint names.
"""

import uuid
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

# Named constraints make migrations reproducible: Alembic can only alter or drop a constraint by
# name, and otherwise each database invents its own (or, on SQLite, none at all).
NAMING_CONVENTION = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


def utcnow() -> datetime:
    return datetime.now(UTC)


def new_id() -> str:
    return str(uuid.uuid4())


class UTCDateTime(sa.TypeDecorator[datetime]):
    """A timezone-aware timestamp that always comes back in UTC.

    SQLite has no time zones: it stores the wall-clock text and returns naive datetimes. Storing
    UTC and tagging it on the way out gives both databases the same aware values (and on SQLite a
    text order that is the time order).
    """

    impl = sa.DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: sa.Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError(f"naive datetime {value!r}: pass a timezone-aware one")
        return value.astimezone(UTC)

    def process_result_value(self, value: datetime | None, dialect: sa.Dialect) -> datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


class RequestState(StrEnum):
    PENDING = "pending"
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"


class CheckpointKind(StrEnum):
    TRAINING_STATE = "training_state"
    SAMPLER = "sampler"
    EXTERNAL = "external"  # save_weights_external: the adapter merged into the base model, a Hugging Face folder


def _in(column: str, values: type[StrEnum]) -> str:
    """SQL for `column IN (...)`, for a CHECK constraint that keeps stray values out."""
    return f"{column} IN ({', '.join(repr(v.value) for v in values)})"


# JSON columns: none_as_null so that Python None is SQL NULL (queryable with IS NULL), not JSON 'null'.
# In-place mutation of a loaded dict/list is not tracked: assign a new value to change one.
def _json(nullable: bool = False) -> Any:
    return mapped_column(sa.JSON(none_as_null=True), nullable=nullable)


class Base(DeclarativeBase):
    metadata = sa.MetaData(naming_convention=NAMING_CONVENTION)
    type_annotation_map = {datetime: UTCDateTime, str: sa.String()}


class Tenant(Base):
    __tablename__ = "tenants"

    id: Mapped[str] = mapped_column(primary_key=True, default=new_id)
    name: Mapped[str] = mapped_column(unique=True)
    disabled: Mapped[bool] = mapped_column(default=False)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class ApiKey(Base):
    """Only the key's SHA-256 is stored: a leaked database does not leak usable keys."""

    __tablename__ = "api_keys"

    id: Mapped[str] = mapped_column(primary_key=True, default=new_id)
    tenant_id: Mapped[str] = mapped_column(sa.ForeignKey("tenants.id"), index=True)
    key_hash: Mapped[str] = mapped_column(unique=True, index=True)  # hex SHA-256 of the full key
    key_prefix: Mapped[str]  # first 12 characters, to tell keys apart in listings
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    revoked_at: Mapped[datetime | None]


class Quota(Base):
    """A tenant's limits; NULL is no limit. Enforced at the API (api/quotas.py)."""

    __tablename__ = "quotas"

    tenant_id: Mapped[str] = mapped_column(sa.ForeignKey("tenants.id"), primary_key=True)
    max_live_models: Mapped[int | None]
    max_lora_rank: Mapped[int | None]
    train_tokens_per_day: Mapped[int | None] = mapped_column(sa.BigInteger)
    sample_tokens_per_day: Mapped[int | None] = mapped_column(sa.BigInteger)
    max_concurrent_requests: Mapped[int | None]
    max_checkpoint_bytes: Mapped[int | None] = mapped_column(sa.BigInteger)
    # The rollout store (db/rollouts.py): trajectories untouched this long are deleted (scheduler/janitor.py);
    # past max_rollout_bytes new recordings are refused, as new checkpoints are past max_checkpoint_bytes.
    rollout_ttl_seconds: Mapped[int | None] = mapped_column(sa.BigInteger)
    max_rollout_bytes: Mapped[int | None] = mapped_column(sa.BigInteger)


QUOTA_FIELDS = ("max_live_models", "max_lora_rank", "train_tokens_per_day", "sample_tokens_per_day",
                "max_concurrent_requests", "max_checkpoint_bytes", "rollout_ttl_seconds", "max_rollout_bytes")


class Project(Base):
    """A name a tenant files sessions under (the SDK's `project_id`), and through them their runs,
    samplers and checkpoints. Made on first use (db/projects.py); two tenants may use the same name."""

    __tablename__ = "projects"

    tenant_id: Mapped[str] = mapped_column(sa.ForeignKey("tenants.id"), primary_key=True)
    id: Mapped[str] = mapped_column(primary_key=True)  # the name itself, as the SDK sends it
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class ClientSession(Base):
    """A client SDK session: groups the models and samplers one `ServiceClient` created."""

    __tablename__ = "sessions"
    __table_args__ = (
        # The project is looked up within the session's own tenant: one tenant's session can never
        # name (or be filed under) another tenant's project, whatever a route does.
        sa.ForeignKeyConstraint(["tenant_id", "project_id"], ["projects.tenant_id", "projects.id"]),
        sa.Index(None, "tenant_id", "project_id"),
    )

    id: Mapped[str] = mapped_column(primary_key=True, default=new_id)
    tenant_id: Mapped[str] = mapped_column(sa.ForeignKey("tenants.id"), index=True)
    project_id: Mapped[str | None]  # None: in no project
    tags: Mapped[list[str]] = _json()
    user_metadata: Mapped[dict[str, Any]] = _json()
    sdk_version: Mapped[str | None]
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    last_heartbeat_at: Mapped[datetime] = mapped_column(default=utcnow)
    finished_at: Mapped[datetime | None]


class TrainingModel(Base):
    """A training run: one LoRA adapter. Its id is "{session_id}:train:{n}"."""

    __tablename__ = "models"

    id: Mapped[str] = mapped_column(primary_key=True)
    tenant_id: Mapped[str] = mapped_column(sa.ForeignKey("tenants.id"), index=True)
    session_id: Mapped[str] = mapped_column(sa.ForeignKey("sessions.id"))
    base_model: Mapped[str]
    # rank, seed, alpha, train_attn, train_mlp, train_unembed
    lora_config: Mapped[dict[str, Any]] = _json()
    user_metadata: Mapped[dict[str, Any]] = _json()
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    deleted_at: Mapped[datetime | None]
    last_applied_seq_id: Mapped[int] = mapped_column(default=0)  # highest seq_id executed
    worker_id: Mapped[str | None]  # the worker holding the adapter; None when not placed
    # copy_weights: the checkpoint this run holds a copy of. Such a run holds that copy only and is
    # never trained (the SDK's contract); it counts as no live model.
    copied_from: Mapped[str | None]


class Sampler(Base):
    """A sampling client's target. Its id is "{session_id}:sample:{n}"."""

    __tablename__ = "samplers"

    id: Mapped[str] = mapped_column(primary_key=True)
    tenant_id: Mapped[str] = mapped_column(sa.ForeignKey("tenants.id"), index=True)
    session_id: Mapped[str] = mapped_column(sa.ForeignKey("sessions.id"))
    base_model: Mapped[str]
    model_path: Mapped[str | None]  # a tinker:// sampler checkpoint; None samples the base model
    # the snapshot folder current when the sampler was created: it samples exactly those weights
    adapter_path: Mapped[str | None]
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class Request(Base):
    """One API call, from receipt to result: the queue and the result store in one table."""

    __tablename__ = "requests"
    __table_args__ = (
        # A retry carries the same (model_id, seq_id): it finds the original instead of queueing
        # twice. NULLs are distinct in both databases, so requests without a seq_id never clash.
        sa.UniqueConstraint("model_id", "seq_id"),
        # The scheduler's scan: oldest requests in a state. Also serves lookups by state alone.
        sa.Index(None, "state", "created_at"),
        sa.CheckConstraint(_in("state", RequestState), name="state"),
    )

    id: Mapped[str] = mapped_column(primary_key=True, default=new_id)
    tenant_id: Mapped[str] = mapped_column(sa.ForeignKey("tenants.id"), index=True)
    # No foreign key: this holds training model ids and sampler ids alike. Lookups by model use the
    # (model_id, seq_id) unique index, whose leading column is model_id.
    model_id: Mapped[str | None]
    seq_id: Mapped[int | None]
    kind: Mapped[str]  # a contract.kinds.RequestKind value: "forward_backward", "optim_step", "sample", ...
    state: Mapped[str] = mapped_column(default=RequestState.PENDING)
    payload: Mapped[bytes] = mapped_column(sa.LargeBinary)  # the body as received
    payload_content_type: Mapped[str]
    result: Mapped[bytes | None] = mapped_column(sa.LargeBinary)
    result_content_type: Mapped[str | None]
    error: Mapped[dict[str, Any] | None] = _json(nullable=True)  # {"error": str, "category": "user"|"server"}
    num_tokens: Mapped[int] = mapped_column(default=0)  # input tokens (the prompt, for samples)
    output_tokens: Mapped[int] = mapped_column(default=0, server_default="0")  # tokens generated (samples), known when done
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    started_at: Mapped[datetime | None]
    finished_at: Mapped[datetime | None]


class Checkpoint(Base):
    __tablename__ = "checkpoints"
    __table_args__ = (sa.CheckConstraint(_in("kind", CheckpointKind), name="kind"),)

    id: Mapped[str] = mapped_column(primary_key=True, default=new_id)
    tenant_id: Mapped[str] = mapped_column(sa.ForeignKey("tenants.id"), index=True)
    model_id: Mapped[str] = mapped_column(index=True)
    kind: Mapped[str]
    name: Mapped[str]
    # "tinker://{model_id}/weights/{name}" or "tinker://{model_id}/sampler_weights/{name}"
    tinker_path: Mapped[str] = mapped_column(unique=True)
    storage_path: Mapped[str]  # where the files are: a local path or an fsspec URL
    size_bytes: Mapped[int] = mapped_column(sa.BigInteger)  # adapter + Adam state can pass 2 GiB
    public: Mapped[bool] = mapped_column(default=False)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    expires_at: Mapped[datetime | None]  # TTL; None keeps it until deleted
    user_metadata: Mapped[dict[str, Any] | None] = _json(nullable=True)  # as the save request carried it
    # An unnamed sampler snapshot: deleted once superseded and unused (scheduler/janitor.py)
    ephemeral: Mapped[bool] = mapped_column(default=False, server_default=sa.false())


class AuditEvent(Base):
    """Something a tenant or an operator did that changes or reads what is stored (db/audit.py)."""

    __tablename__ = "audit_events"
    __table_args__ = (sa.Index(None, "tenant_id", "created_at"), sa.Index(None, "created_at"))

    id: Mapped[str] = mapped_column(primary_key=True, default=new_id)
    tenant_id: Mapped[str | None] = mapped_column(sa.ForeignKey("tenants.id"))  # None: no tenant's (operator keys)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    category: Mapped[str]  # what the SDK's event_type filter names: "checkpoints", "projects", "organizations"
    event: Mapped[str]  # "<resource>_<action>", e.g. checkpoint_copy, project_create, api_key_revoke
    actor: Mapped[str]  # "api_key:<prefix>" or "operator"
    details: Mapped[dict[str, Any]] = _json()


class RecordedSequence(Base):
    """A sequence sampled with record_stability_info: what stable_reinforce trains it against
    (db/stability.py). Kept one day after sampling or after its last use in training."""

    __tablename__ = "recorded_sequences"

    id: Mapped[str] = mapped_column(primary_key=True)  # the sequence_id asample answered with
    tenant_id: Mapped[str] = mapped_column(sa.ForeignKey("tenants.id"))
    sampler_id: Mapped[str | None]  # None: sampled by legacy addressing, without a sampling session
    policy_version: Mapped[int | None]  # optimizer steps of the sampled snapshot; None: the base model
    prompt_tokens: Mapped[bytes] = mapped_column(sa.LargeBinary)  # int32 little-endian
    tokens: Mapped[bytes] = mapped_column(sa.LargeBinary)  # int32 little-endian, the sampled tokens
    logprobs: Mapped[bytes] = mapped_column(sa.LargeBinary)  # float32 little-endian, the sampler's, one per token
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    expires_at: Mapped[datetime] = mapped_column(index=True)  # pruning scans it


class RolloutTrajectory(Base):
    """One agent session's calls to the inference API (api/inference/): the rollout store's unit of
    training. Named by the caller (X-Loraplex-Session, else metadata.session_id, else user); a call
    that names none is a trajectory of its own."""

    __tablename__ = "rollout_trajectories"
    __table_args__ = (
        sa.UniqueConstraint("tenant_id", "session_id"),
        sa.Index(None, "tenant_id", "updated_at"),  # the listing's order and the janitor's TTL sweep
    )

    id: Mapped[str] = mapped_column(primary_key=True, default=new_id)
    tenant_id: Mapped[str] = mapped_column(sa.ForeignKey("tenants.id"))
    session_id: Mapped[str]  # the caller's name for it; unique per tenant, two tenants may share one
    reward: Mapped[float | None]
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow)  # its last turn (or reward); the TTL counts from it
    size_bytes: Mapped[int] = mapped_column(sa.BigInteger, default=0, server_default="0")  # its turns' stored bytes


class RolloutTurn(Base):
    """One call of a trajectory: the prompt as the sampler saw it, which weights answered, and the
    request and response as they went over the wire. Its id is the response's id."""

    __tablename__ = "rollout_turns"
    __table_args__ = (
        sa.UniqueConstraint("trajectory_id", "turn"),
        sa.Index(None, "adapter_path", "created_at"),  # the janitor: did the proxy sample a snapshot lately
    )

    id: Mapped[str] = mapped_column(primary_key=True)
    trajectory_id: Mapped[str] = mapped_column(sa.ForeignKey("rollout_trajectories.id"))
    tenant_id: Mapped[str] = mapped_column(sa.ForeignKey("tenants.id"))
    turn: Mapped[int]  # 0, 1, ...: the order the trajectory's calls finished in
    api: Mapped[str]  # "chat.completions" | "completions" | "responses" | "anthropic.messages"
    model: Mapped[str]  # as the request named it: a sampler path, a policy alias, the base model
    sampler_path: Mapped[str | None]  # the tinker:// sampler checkpoint it resolved to; None: the base model
    adapter_path: Mapped[str | None]  # that checkpoint's snapshot folder (server side, never shown)
    policy_version: Mapped[int | None]  # optimizer steps of the snapshot; None: the base model
    request_id: Mapped[str]  # the sample request (requests table) that generated it
    prompt_tokens: Mapped[bytes] = mapped_column(sa.LargeBinary)  # int32 little-endian
    request_body: Mapped[dict[str, Any]] = _json()
    response_body: Mapped[dict[str, Any]] = _json()
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class RolloutSample(Base):
    """One choice of a turn: the sampled tokens (stop token included) and the sampler's logprob of each."""

    __tablename__ = "rollout_samples"

    turn_id: Mapped[str] = mapped_column(sa.ForeignKey("rollout_turns.id"), primary_key=True)
    choice: Mapped[int] = mapped_column(primary_key=True)
    tokens: Mapped[bytes] = mapped_column(sa.LargeBinary)  # int32 little-endian
    logprobs: Mapped[bytes] = mapped_column(sa.LargeBinary)  # float32 little-endian, one per token
    finish_reason: Mapped[str]  # as answered: "stop" | "length" | "tool_calls"
    reward: Mapped[float | None]  # this choice's own reward; None: the trajectory's


class OperatorKey(Base):
    """An operator's key for the dashboard's admin view (`loraplex-admin operator-keys issue`):
    `tmo-` + a secret, stored as its SHA-256 as tenant keys are."""

    __tablename__ = "operator_keys"

    id: Mapped[str] = mapped_column(primary_key=True, default=new_id)
    key_hash: Mapped[str] = mapped_column(unique=True)
    key_prefix: Mapped[str]
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    revoked_at: Mapped[datetime | None]


class DashboardSession(Base):
    """A dashboard login: the cookie holds a random id, this row its SHA-256 and the key it was
    opened with (exactly one of the two), so revoking the key ends the session."""

    __tablename__ = "dashboard_sessions"

    id: Mapped[str] = mapped_column(primary_key=True)  # hex SHA-256 of the cookie's value
    api_key_id: Mapped[str | None] = mapped_column(sa.ForeignKey("api_keys.id"))
    operator_key_id: Mapped[str | None] = mapped_column(sa.ForeignKey("operator_keys.id"))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    expires_at: Mapped[datetime]


class ServiceMetric(Base):
    """Numbers the service measured for a training run, one row per source: a forward_backward or
    optim_step outcome, a sample, a rollout turned into datums (db/run_metrics.py reads them as series)."""

    __tablename__ = "run_service_metrics"
    __table_args__ = (sa.Index(None, "run_id", "step"),)

    id: Mapped[str] = mapped_column(primary_key=True, default=new_id)
    tenant_id: Mapped[str] = mapped_column(sa.ForeignKey("tenants.id"))
    run_id: Mapped[str]  # the training model; no foreign key, as requests.model_id
    source: Mapped[str]  # a RequestKind value, or "rollout_datums"
    request_id: Mapped[str | None]
    step: Mapped[int]  # the optimizer step the numbers belong to (x axis)
    numbers: Mapped[dict[str, float]] = _json()
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class ClientMetric(Base):
    """A number the client logged for a run at a step (`log_metrics`); logging it again replaces it."""

    __tablename__ = "run_client_metrics"

    run_id: Mapped[str] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(primary_key=True)
    step: Mapped[int] = mapped_column(primary_key=True)
    tenant_id: Mapped[str] = mapped_column(sa.ForeignKey("tenants.id"))
    value: Mapped[float] = mapped_column(sa.Double)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class SchedulerBeat(Base):
    """A running scheduler, refreshed every few seconds (scheduler/liveness.py): tools that change a
    model's stored state behind the service's back (`loraplex-admin models reset`) refuse while one
    beats, since the process it feeds holds the models' weights in memory and would write over them."""

    __tablename__ = "scheduler_beats"

    id: Mapped[str] = mapped_column(primary_key=True, default=new_id)
    host: Mapped[str]
    pid: Mapped[int]
    started_at: Mapped[datetime] = mapped_column(default=utcnow)
    beat_at: Mapped[datetime] = mapped_column(default=utcnow)
    # trainer name -> contract.residency.ResidencyStats (as JSON) of the trainers it feeds, as of beat_at
    trainers: Mapped[dict[str, Any] | None] = _json(nullable=True)

"""Initial schema: tenants, api_keys, sessions, models, samplers, requests, checkpoints.

Revision ID: 0001
Revises:
Create Date: 2026-11-30

Written out in full (not imported from db.models) so that this revision keeps meaning what it
meant when later revisions change the models. Names go through op.f(): they are final, the naming
convention must not be applied to them a second time.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | Sequence[str] | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def _id() -> sa.Column:
    return sa.Column("id", sa.String(), nullable=False)


def _foreign_key(table: str, column: str, parent: str) -> sa.Column:
    fk = sa.ForeignKey(f"{parent}.id", name=op.f(f"fk_{table}_{column}_{parent}"))
    return sa.Column(column, sa.String(), fk, nullable=False)


def _tenant_id(table: str) -> sa.Column:
    return _foreign_key(table, "tenant_id", "tenants")


def _timestamp(name: str, nullable: bool = False) -> sa.Column:
    return sa.Column(name, sa.DateTime(timezone=True), nullable=nullable)


def upgrade() -> None:
    op.create_table(
        "tenants",
        _id(),
        sa.Column("name", sa.String(), nullable=False),
        sa.Column("disabled", sa.Boolean(), nullable=False),
        _timestamp("created_at"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_tenants")),
        sa.UniqueConstraint("name", name=op.f("uq_tenants_name")),
    )

    op.create_table(
        "api_keys",
        _id(),
        _tenant_id("api_keys"),
        sa.Column("key_hash", sa.String(), nullable=False),
        sa.Column("key_prefix", sa.String(), nullable=False),
        _timestamp("created_at"),
        _timestamp("revoked_at", nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_api_keys")),
    )
    op.create_index(op.f("ix_api_keys_key_hash"), "api_keys", ["key_hash"], unique=True)
    op.create_index(op.f("ix_api_keys_tenant_id"), "api_keys", ["tenant_id"])

    op.create_table(
        "sessions",
        _id(),
        _tenant_id("sessions"),
        sa.Column("tags", sa.JSON(), nullable=False),
        sa.Column("user_metadata", sa.JSON(), nullable=False),
        sa.Column("sdk_version", sa.String(), nullable=True),
        _timestamp("created_at"),
        _timestamp("last_heartbeat_at"),
        _timestamp("finished_at", nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_sessions")),
    )
    op.create_index(op.f("ix_sessions_tenant_id"), "sessions", ["tenant_id"])

    op.create_table(
        "models",
        _id(),
        _tenant_id("models"),
        _foreign_key("models", "session_id", "sessions"),
        sa.Column("base_model", sa.String(), nullable=False),
        sa.Column("lora_config", sa.JSON(), nullable=False),
        sa.Column("user_metadata", sa.JSON(), nullable=False),
        _timestamp("created_at"),
        _timestamp("deleted_at", nullable=True),
        sa.Column("last_applied_seq_id", sa.Integer(), nullable=False),
        sa.Column("worker_id", sa.String(), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_models")),
    )
    op.create_index(op.f("ix_models_tenant_id"), "models", ["tenant_id"])

    op.create_table(
        "samplers",
        _id(),
        _tenant_id("samplers"),
        _foreign_key("samplers", "session_id", "sessions"),
        sa.Column("base_model", sa.String(), nullable=False),
        sa.Column("model_path", sa.String(), nullable=True),
        _timestamp("created_at"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_samplers")),
    )
    op.create_index(op.f("ix_samplers_tenant_id"), "samplers", ["tenant_id"])

    op.create_table(
        "requests",
        _id(),
        _tenant_id("requests"),
        sa.Column("model_id", sa.String(), nullable=True),
        sa.Column("seq_id", sa.Integer(), nullable=True),
        sa.Column("kind", sa.String(), nullable=False),
        sa.Column("state", sa.String(), nullable=False),
        sa.Column("payload", sa.LargeBinary(), nullable=False),
        sa.Column("payload_content_type", sa.String(), nullable=False),
        sa.Column("result", sa.LargeBinary(), nullable=True),
        sa.Column("result_content_type", sa.String(), nullable=True),
        sa.Column("error", sa.JSON(), nullable=True),
        sa.Column("num_tokens", sa.Integer(), nullable=False),
        _timestamp("created_at"),
        _timestamp("started_at", nullable=True),
        _timestamp("finished_at", nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_requests")),
        sa.UniqueConstraint("model_id", "seq_id", name=op.f("uq_requests_model_id_seq_id")),
        sa.CheckConstraint(
            "state IN ('pending', 'running', 'done', 'failed')", name=op.f("ck_requests_state")
        ),
    )
    op.create_index(op.f("ix_requests_tenant_id"), "requests", ["tenant_id"])
    op.create_index(op.f("ix_requests_state_created_at"), "requests", ["state", "created_at"])

    op.create_table(
        "checkpoints",
        _id(),
        _tenant_id("checkpoints"),
        sa.Column("model_id", sa.String(), nullable=False),
        sa.Column("kind", sa.String(), nullable=False),
        sa.Column("name", sa.String(), nullable=False),
        sa.Column("tinker_path", sa.String(), nullable=False),
        sa.Column("storage_path", sa.String(), nullable=False),
        sa.Column("size_bytes", sa.BigInteger(), nullable=False),
        sa.Column("public", sa.Boolean(), nullable=False),
        _timestamp("created_at"),
        _timestamp("expires_at", nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_checkpoints")),
        sa.UniqueConstraint("tinker_path", name=op.f("uq_checkpoints_tinker_path")),
        sa.CheckConstraint("kind IN ('training_state', 'sampler')", name=op.f("ck_checkpoints_kind")),
    )
    op.create_index(op.f("ix_checkpoints_tenant_id"), "checkpoints", ["tenant_id"])
    op.create_index(op.f("ix_checkpoints_model_id"), "checkpoints", ["model_id"])


def downgrade() -> None:
    # Children before parents; dropping a table drops its indexes and constraints with it.
    for table in ("checkpoints", "requests", "samplers", "models", "sessions", "api_keys", "tenants"):
        op.drop_table(table)

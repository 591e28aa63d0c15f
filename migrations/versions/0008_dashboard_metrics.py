"""The dashboard: operator keys, login sessions, and the metrics of training runs (service and client).

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-04

Written out in full, not imported from db.models (as 0001 explains).
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | Sequence[str] | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "operator_keys",
        sa.Column("id", sa.String(), nullable=False),
        sa.Column("key_hash", sa.String(), nullable=False),
        sa.Column("key_prefix", sa.String(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("revoked_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_operator_keys")),
        sa.UniqueConstraint("key_hash", name=op.f("uq_operator_keys_key_hash")),
    )
    op.create_table(
        "dashboard_sessions",
        sa.Column("id", sa.String(), nullable=False),
        sa.Column("api_key_id", sa.String(),
                  sa.ForeignKey("api_keys.id", name=op.f("fk_dashboard_sessions_api_key_id_api_keys")), nullable=True),
        sa.Column("operator_key_id", sa.String(),
                  sa.ForeignKey("operator_keys.id", name=op.f("fk_dashboard_sessions_operator_key_id_operator_keys")),
                  nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_dashboard_sessions")),
    )
    op.create_table(
        "run_service_metrics",
        sa.Column("id", sa.String(), nullable=False),
        sa.Column("tenant_id", sa.String(),
                  sa.ForeignKey("tenants.id", name=op.f("fk_run_service_metrics_tenant_id_tenants")), nullable=False),
        sa.Column("run_id", sa.String(), nullable=False),
        sa.Column("source", sa.String(), nullable=False),
        sa.Column("request_id", sa.String(), nullable=True),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("numbers", sa.JSON(none_as_null=True), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_run_service_metrics")),
    )
    op.create_index(op.f("ix_run_service_metrics_run_id_step"), "run_service_metrics", ["run_id", "step"])
    op.create_table(
        "run_client_metrics",
        sa.Column("run_id", sa.String(), nullable=False),
        sa.Column("name", sa.String(), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("tenant_id", sa.String(),
                  sa.ForeignKey("tenants.id", name=op.f("fk_run_client_metrics_tenant_id_tenants")), nullable=False),
        sa.Column("value", sa.Double(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("run_id", "name", "step", name=op.f("pk_run_client_metrics")),
    )


def downgrade() -> None:
    op.drop_table("run_client_metrics")
    op.drop_index(op.f("ix_run_service_metrics_run_id_step"), table_name="run_service_metrics")
    op.drop_table("run_service_metrics")
    op.drop_table("dashboard_sessions")
    op.drop_table("operator_keys")

"""The rollout store: trajectories, turns and sampled choices of the inference API (api/inference/).

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-06

Written out in full, not imported from db.models (as 0001 explains).
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | Sequence[str] | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "rollout_trajectories",
        sa.Column("id", sa.String(), nullable=False),
        sa.Column("tenant_id", sa.String(),
                  sa.ForeignKey("tenants.id", name=op.f("fk_rollout_trajectories_tenant_id_tenants")), nullable=False),
        sa.Column("session_id", sa.String(), nullable=False),
        sa.Column("reward", sa.Double(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_rollout_trajectories")),
        sa.UniqueConstraint("tenant_id", "session_id", name=op.f("uq_rollout_trajectories_tenant_id_session_id")),
    )
    op.create_table(
        "rollout_turns",
        sa.Column("id", sa.String(), nullable=False),
        sa.Column("trajectory_id", sa.String(),
                  sa.ForeignKey("rollout_trajectories.id",
                                name=op.f("fk_rollout_turns_trajectory_id_rollout_trajectories")), nullable=False),
        sa.Column("tenant_id", sa.String(),
                  sa.ForeignKey("tenants.id", name=op.f("fk_rollout_turns_tenant_id_tenants")), nullable=False),
        sa.Column("turn", sa.Integer(), nullable=False),
        sa.Column("api", sa.String(), nullable=False),
        sa.Column("model", sa.String(), nullable=False),
        sa.Column("sampler_path", sa.String(), nullable=True),
        sa.Column("adapter_path", sa.String(), nullable=True),
        sa.Column("policy_version", sa.Integer(), nullable=True),
        sa.Column("request_id", sa.String(), nullable=False),
        sa.Column("prompt_tokens", sa.LargeBinary(), nullable=False),
        sa.Column("request_body", sa.JSON(none_as_null=True), nullable=False),
        sa.Column("response_body", sa.JSON(none_as_null=True), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_rollout_turns")),
        sa.UniqueConstraint("trajectory_id", "turn", name=op.f("uq_rollout_turns_trajectory_id_turn")),
    )
    op.create_table(
        "rollout_samples",
        sa.Column("turn_id", sa.String(),
                  sa.ForeignKey("rollout_turns.id", name=op.f("fk_rollout_samples_turn_id_rollout_turns")),
                  nullable=False),
        sa.Column("choice", sa.Integer(), nullable=False),
        sa.Column("tokens", sa.LargeBinary(), nullable=False),
        sa.Column("logprobs", sa.LargeBinary(), nullable=False),
        sa.Column("finish_reason", sa.String(), nullable=False),
        sa.Column("reward", sa.Double(), nullable=True),
        sa.PrimaryKeyConstraint("turn_id", "choice", name=op.f("pk_rollout_samples")),
    )


def downgrade() -> None:
    op.drop_table("rollout_samples")
    op.drop_table("rollout_turns")
    op.drop_table("rollout_trajectories")

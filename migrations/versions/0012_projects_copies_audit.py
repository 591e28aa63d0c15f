"""Projects (a tenant's names for groups of sessions), runs that hold a copied checkpoint, and the
audit log.

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-06

Written out in full, not imported from db.models (as 0001 explains).
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0012"
down_revision: str | Sequence[str] | None = "0011"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "projects",
        sa.Column("tenant_id", sa.String(),
                  sa.ForeignKey("tenants.id", name=op.f("fk_projects_tenant_id_tenants")), nullable=False),
        sa.Column("id", sa.String(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("tenant_id", "id", name=op.f("pk_projects")),
    )
    with op.batch_alter_table("sessions") as batch:
        batch.add_column(sa.Column("project_id", sa.String(), nullable=True))
        batch.create_foreign_key(op.f("fk_sessions_tenant_id_projects"), "projects",
                                 ["tenant_id", "project_id"], ["tenant_id", "id"])
        batch.create_index(op.f("ix_sessions_tenant_id_project_id"), ["tenant_id", "project_id"])
    with op.batch_alter_table("models") as batch:
        batch.add_column(sa.Column("copied_from", sa.String(), nullable=True))
    op.create_table(
        "audit_events",
        sa.Column("id", sa.String(), nullable=False),
        sa.Column("tenant_id", sa.String(),
                  sa.ForeignKey("tenants.id", name=op.f("fk_audit_events_tenant_id_tenants")), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("category", sa.String(), nullable=False),
        sa.Column("event", sa.String(), nullable=False),
        sa.Column("actor", sa.String(), nullable=False),
        sa.Column("details", sa.JSON(none_as_null=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_audit_events")),
    )
    op.create_index(op.f("ix_audit_events_tenant_id_created_at"), "audit_events", ["tenant_id", "created_at"])
    op.create_index(op.f("ix_audit_events_created_at"), "audit_events", ["created_at"])


def downgrade() -> None:
    op.drop_index(op.f("ix_audit_events_created_at"), table_name="audit_events")
    op.drop_index(op.f("ix_audit_events_tenant_id_created_at"), table_name="audit_events")
    op.drop_table("audit_events")
    with op.batch_alter_table("models") as batch:
        batch.drop_column("copied_from")
    with op.batch_alter_table("sessions") as batch:
        batch.drop_index(op.f("ix_sessions_tenant_id_project_id"))
        batch.drop_constraint(op.f("fk_sessions_tenant_id_projects"), type_="foreignkey")
        batch.drop_column("project_id")
    op.drop_table("projects")

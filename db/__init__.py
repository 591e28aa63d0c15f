"""Persistence: SQLAlchemy models (`db.models`), engines and sessions (`db.session`).

The schema itself is owned by the Alembic migrations in `migrations/`; `upgrade_to_head` applies them.
"""

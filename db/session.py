"""Engines, sessions and schema upgrades for a database URL (SQLite or Postgres)."""

from pathlib import Path
from typing import Any

import sqlalchemy as sa
from alembic import command
from alembic.config import Config
from sqlalchemy.orm import Session, sessionmaker
from sqlalchemy.pool import StaticPool

# alembic.ini sits beside the db package (and names migrations/ relative to itself), so upgrades
# work from any directory.
ALEMBIC_INI = Path(__file__).resolve().parent.parent / "alembic.ini"


def normalize_url(url: str | sa.URL) -> sa.URL:
    """Parse a URL; a bare postgresql:// gets the psycopg 3 driver (psycopg2 is not installed)."""
    parsed = sa.make_url(url)
    if parsed.drivername == "postgresql":
        parsed = parsed.set(drivername="postgresql+psycopg")
    return parsed


def make_engine(url: str | sa.URL) -> sa.Engine:
    parsed = normalize_url(url)
    if parsed.get_backend_name() != "sqlite":
        # Pre-ping replaces connections the server dropped (restarts, idle timeouts) before use.
        return sa.create_engine(parsed, pool_pre_ping=True)

    in_memory = parsed.database in (None, "", ":memory:")
    engine = sa.create_engine(
        parsed,
        # The API, scheduler and executor threads share the engine; the pool serialises each
        # connection's use, so SQLite's own same-thread guard only gets in the way.
        connect_args={"check_same_thread": False},
        # An in-memory database lives and dies with its connection: share that one connection.
        poolclass=StaticPool if in_memory else None,
    )

    @sa.event.listens_for(engine, "connect")
    def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
        cursor = dbapi_connection.cursor()
        # WAL lets readers (result polls) proceed while the scheduler writes.
        if not in_memory:
            cursor.execute("PRAGMA journal_mode=WAL")
            # In WAL mode NORMAL still survives a crash of the process (what the service promises);
            # only an OS crash or power loss may lose the last commits. FULL fsyncs every commit.
            cursor.execute("PRAGMA synchronous=NORMAL")
        # SQLite ignores foreign keys unless asked, per connection.
        cursor.execute("PRAGMA foreign_keys=ON")
        # Wait for a competing writer instead of failing at once with "database is locked".
        cursor.execute("PRAGMA busy_timeout=5000")
        cursor.close()

    return engine


def make_session_factory(engine: sa.Engine) -> sessionmaker[Session]:
    # expire_on_commit=False: objects stay readable after commit (e.g. to build a response).
    return sessionmaker(engine, expire_on_commit=False)


def alembic_config(url: str | sa.URL) -> Config:
    """The repo's Alembic config, pointed at `url` (passed as an attribute: ini values would
    need '%' escaped, and a password may contain one)."""
    config = Config(str(ALEMBIC_INI))
    config.attributes["url"] = normalize_url(url)
    return config


def upgrade_to_head(target: str | sa.URL | sa.Engine) -> None:
    """Apply every migration not yet applied. Given an engine, migrate through one of its
    connections: the only way to reach an in-memory SQLite database, which lives in that engine."""
    if not isinstance(target, sa.Engine):
        command.upgrade(alembic_config(target), "head")
        return
    config = alembic_config(target.url)
    with target.connect() as connection:
        config.attributes["connection"] = connection
        command.upgrade(config, "head")

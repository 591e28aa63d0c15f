"""make_engine's SQLite settings, and migrating through an engine (the in-memory case)."""

import threading

import pytest
import sqlalchemy as sa

from db.models import Base, ClientSession
from db.session import make_engine, make_session_factory, normalize_url, upgrade_to_head


def pragma(engine: sa.Engine, name: str):
    with engine.connect() as connection:
        return connection.exec_driver_sql(f"PRAGMA {name}").scalar()


def test_sqlite_file_engine_uses_wal_and_enforces_foreign_keys(tmp_path):
    engine = make_engine(f"sqlite:///{tmp_path / 'x.db'}")
    assert (pragma(engine, "journal_mode"), pragma(engine, "foreign_keys")) == ("wal", 1)
    engine.dispose()


def test_in_memory_database_is_migrated_through_its_engine_and_shared_across_threads():
    engine = make_engine("sqlite://")
    upgrade_to_head(engine)
    # The migration switched foreign keys off for its rebuilds, and must have switched them back.
    assert pragma(engine, "foreign_keys") == 1

    seen: list[set[str]] = []
    worker = threading.Thread(target=lambda: seen.append(set(sa.inspect(engine).get_table_names())))
    worker.start()
    worker.join()
    assert seen == [set(Base.metadata.tables) | {"alembic_version"}]

    with make_session_factory(engine)() as db, pytest.raises(sa.exc.IntegrityError):
        db.add(ClientSession(tenant_id="nobody", tags=[], user_metadata={}))
        db.commit()
    engine.dispose()


def test_bare_postgresql_url_gets_the_psycopg_driver():
    assert normalize_url("postgresql://u@h/d").drivername == "postgresql+psycopg"
    assert normalize_url("sqlite:///x.db").drivername == "sqlite"

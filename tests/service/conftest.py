"""A real embedded server on loopback (uvicorn in a thread), SQLite or Postgres, the tiny model."""

from __future__ import annotations

import uuid

import pytest
import sqlalchemy as sa

from service.embedded import ServerThread, free_port
from service.settings import Settings

POSTGRES_ADMIN_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"


def postgres_database() -> str:
    """A fresh, uniquely named database (dropped by the caller)."""
    name = f"loraplex_test_{uuid.uuid4().hex[:10]}"
    engine = sa.create_engine(POSTGRES_ADMIN_URL, isolation_level="AUTOCOMMIT")
    with engine.connect() as c:
        c.execute(sa.text(f'CREATE DATABASE "{name}"'))
    engine.dispose()
    return name


def drop_postgres_database(name: str) -> None:
    engine = sa.create_engine(POSTGRES_ADMIN_URL, isolation_level="AUTOCOMMIT")
    with engine.connect() as c:
        c.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    engine.dispose()


@pytest.fixture(scope="module", params=["sqlite", pytest.param("postgres", marks=pytest.mark.distributed)])
def server(request, tmp_path_factory):
    data_dir = tmp_path_factory.mktemp("loraplex")
    database_url, pg_name = "", None
    if request.param == "postgres":
        pg_name = postgres_database()
        database_url = f"postgresql+psycopg://postgres@127.0.0.1:5432/{pg_name}"
    # SQLite runs the engine in-process on a local store; Postgres runs it in a child process on
    # a remote (WebDAV) store: both executors and both kinds of store get covered.
    # No sampler here (vLLM allows one engine per process): tests/service/test_sampling.py has its own.
    store_url = request.getfixturevalue("webdav_store")() if request.param == "postgres" else ""
    settings = Settings(data_dir=data_dir, database_url=database_url, port=free_port(), base_model="tiny",
                        cycle_gather_seconds=0.3, long_poll_seconds=5, engine_process=request.param == "postgres",
                        sampler_enabled=False, store_url=store_url)
    running = ServerThread(settings)
    yield running
    running.stop()
    if pg_name:
        drop_postgres_database(pg_name)

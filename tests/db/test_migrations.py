"""The Alembic migrations build exactly the schema the models describe, on SQLite and Postgres."""

import os
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta, timezone
from functools import cache

import pytest
import sqlalchemy as sa
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from alembic.script import ScriptDirectory

from db.models import (
    ApiKey,
    Base,
    Checkpoint,
    ClientSession,
    Request,
    Sampler,
    Tenant,
    TrainingModel,
)
from db.session import alembic_config, make_engine, make_session_factory, upgrade_to_head

# A maintenance database on a server where we may CREATE DATABASE; CI starts one like this.
POSTGRES_ADMIN_URL = os.environ.get(
    "LORAPLEX_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
)

HEAD = ScriptDirectory.from_config(alembic_config("sqlite://")).get_current_head()


@cache
def postgres_unreachable() -> str | None:
    """Why Postgres cannot be used, or None when it can (asked once per test run)."""
    engine = sa.create_engine(POSTGRES_ADMIN_URL, connect_args={"connect_timeout": 2})
    try:
        with engine.connect():
            return None
    except sa.exc.OperationalError as error:
        first_line = str(error.orig).splitlines()[0]
        return f"Postgres unreachable at {engine.url.render_as_string()}: {first_line}"
    finally:
        engine.dispose()


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.distributed)])
def database_url(request: pytest.FixtureRequest, tmp_path) -> Iterator[str]:
    """An empty database: a fresh SQLite file, or a fresh uniquely named Postgres database."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'loraplex.db'}"
        return
    if reason := postgres_unreachable():
        pytest.skip(reason)
    name = f"loraplex_test_{uuid.uuid4().hex[:12]}"
    admin = sa.create_engine(POSTGRES_ADMIN_URL, isolation_level="AUTOCOMMIT")  # no DDL in a transaction
    try:
        with admin.connect() as connection:
            connection.exec_driver_sql(f'CREATE DATABASE "{name}"')
        yield sa.make_url(POSTGRES_ADMIN_URL).set(database=name).render_as_string(hide_password=False)
        with admin.connect() as connection:
            connection.exec_driver_sql(f'DROP DATABASE "{name}" WITH (FORCE)')
    finally:
        admin.dispose()


@pytest.fixture
def engine(database_url: str, tmp_path, monkeypatch: pytest.MonkeyPatch) -> Iterator[sa.Engine]:
    """An engine on the database migrated to head (from elsewhere than the repo root)."""
    monkeypatch.chdir(tmp_path)
    upgrade_to_head(database_url)
    engine = make_engine(database_url)
    yield engine
    engine.dispose()


def table_names(engine: sa.Engine) -> set[str]:
    return set(sa.inspect(engine).get_table_names())


def test_upgrade_from_empty_builds_the_models_schema(engine: sa.Engine):
    assert table_names(engine) == set(Base.metadata.tables) | {"alembic_version"}
    with engine.connect() as connection:
        context = MigrationContext.configure(
            connection, opts={"compare_type": True, "compare_server_default": True}
        )
        assert compare_metadata(context, Base.metadata) == []
        assert context.get_current_revision() == HEAD


def test_upgrade_creates_the_named_check_constraints(engine: sa.Engine):
    # compare_metadata does not look at CHECK constraints, so check them by name here.
    inspector = sa.inspect(engine)
    assert {c["name"] for c in inspector.get_check_constraints("requests")} == {"ck_requests_state"}
    assert {c["name"] for c in inspector.get_check_constraints("checkpoints")} == {"ck_checkpoints_kind"}


def test_downgrade_to_base_removes_every_table(engine: sa.Engine, database_url: str):
    command.downgrade(alembic_config(database_url), "base")
    assert table_names(engine) - {"alembic_version"} == set()


def add_tenant_and_session(db) -> tuple[Tenant, ClientSession]:
    tenant = Tenant(name="alice")
    db.add(tenant)
    db.flush()  # column defaults, the id among them, are filled in on flush
    session = ClientSession(tenant_id=tenant.id, tags=["rl"], user_metadata={"run": 1})
    db.add(session)
    db.flush()
    return tenant, session


def pending_request(tenant: Tenant, model_id: str | None, seq_id: int | None, **fields) -> Request:
    return Request(
        tenant_id=tenant.id,
        model_id=model_id,
        seq_id=seq_id,
        kind="forward_backward",
        payload=b"\x0a\x00",
        payload_content_type="application/x-protobuf",
        **fields,
    )


def test_orm_round_trip_through_every_table(engine: sa.Engine):
    make_session = make_session_factory(engine)
    paris = timezone(timedelta(hours=2))
    with make_session.begin() as db:
        tenant, session = add_tenant_and_session(db)
        model_id, sampler_id = f"{session.id}:train:0", f"{session.id}:sample:0"
        lora = {"rank": 8, "seed": 0, "alpha": 16,
                "train_attn": True, "train_mlp": True, "train_unembed": False}
        db.add_all([
            ApiKey(tenant_id=tenant.id, key_hash="ab" * 32, key_prefix="tml-12345678"),
            TrainingModel(id=model_id, tenant_id=tenant.id, session_id=session.id, base_model="tiny",
                          lora_config=lora, user_metadata={}),
            Sampler(id=sampler_id, tenant_id=tenant.id, session_id=session.id, base_model="tiny"),
            pending_request(tenant, model_id, 0, created_at=datetime(2026, 1, 1, 12, tzinfo=paris)),
            Checkpoint(tenant_id=tenant.id, model_id=model_id, kind="sampler", name="v1",
                       tinker_path=f"tinker://{model_id}/sampler_weights/v1", storage_path="/ckpt/v1",
                       size_bytes=3 * 2**30),
        ])

    with make_session() as db:
        assert db.scalars(sa.select(Tenant)).one().disabled is False
        assert db.scalars(sa.select(ApiKey)).one().revoked_at is None
        assert db.scalars(sa.select(ClientSession)).one().tags == ["rl"]
        model = db.get(TrainingModel, model_id)
        assert (model.lora_config, model.last_applied_seq_id, model.worker_id) == (lora, 0, None)
        assert db.get(Sampler, sampler_id).model_path is None
        # The error column is SQL NULL (not JSON null) until a request fails.
        request = db.scalars(sa.select(Request).where(Request.error.is_(None))).one()
        assert (request.state, request.num_tokens, request.payload) == ("pending", 0, b"\x0a\x00")
        # Any zone in, the same instant out, tagged UTC: on SQLite too.
        assert request.created_at == datetime(2026, 1, 1, 10, tzinfo=UTC)
        assert request.created_at.tzinfo is UTC
        assert db.scalars(sa.select(Checkpoint)).one().size_bytes == 3 * 2**30


def test_retry_with_the_same_model_and_seq_id_is_never_stored_twice(engine: sa.Engine):
    make_session = make_session_factory(engine)
    with make_session.begin() as db:
        tenant, _ = add_tenant_and_session(db)
        # Requests without a seq_id (or without a model) never clash: NULLs are distinct.
        db.add_all([pending_request(tenant, "m", 1), pending_request(tenant, "m", None),
                    pending_request(tenant, "m", None), pending_request(tenant, None, None)])

    with make_session() as db, pytest.raises(sa.exc.IntegrityError, match="(?i)unique"):
        db.add(pending_request(tenant, "m", 1))
        db.commit()


def test_constraints_reject_unknown_states_and_tenants(engine: sa.Engine):
    make_session = make_session_factory(engine)
    with make_session.begin() as db:
        tenant, _ = add_tenant_and_session(db)

    with make_session() as db, pytest.raises(sa.exc.IntegrityError, match="(?i)check"):
        db.add(pending_request(tenant, "m", 1, state="exploded"))
        db.commit()
    # Foreign keys hold on SQLite too (make_engine switches them on for every connection).
    with make_session() as db, pytest.raises(sa.exc.IntegrityError, match="(?i)foreign key"):
        db.add(ClientSession(tenant_id="nobody", tags=[], user_metadata={}))
        db.commit()

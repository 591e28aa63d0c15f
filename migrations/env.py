"""Alembic environment: runs the revisions in versions/ against the Loraplex database."""

from logging.config import fileConfig

import sqlalchemy as sa
from alembic import context

from db.models import Base
from db.session import make_engine, normalize_url
from service.settings import Settings

config = context.config
target_metadata = Base.metadata

# Log setup from alembic.ini only for the alembic command line: called from the service
# (upgrade_to_head) it must not replace the application's logging.
if config.cmd_opts is not None and config.config_file_name is not None:
    fileConfig(config.config_file_name, disable_existing_loggers=False)


def database_url() -> sa.URL:
    # the service passes its URL; the alembic command line takes LORAPLEX_DATABASE_URL, else alembic.ini's
    url = config.attributes.get("url") or Settings().database_url
    return normalize_url(url or config.get_main_option("sqlalchemy.url"))


def configure_options(dialect_name: str) -> dict:
    return {
        "target_metadata": target_metadata,
        # SQLite cannot ALTER most things: batch mode rebuilds the table (copy, drop, rename).
        "render_as_batch": dialect_name == "sqlite",
        "compare_type": True,
    }


def run_migrations_offline() -> None:
    """Print the SQL instead of running it (`alembic upgrade head --sql`)."""
    url = database_url()
    context.configure(url=url, literal_binds=True, **configure_options(url.get_backend_name()))
    with context.begin_transaction():
        context.run_migrations()


# Several processes (API replicas, the scheduler) may upgrade one Postgres database as they start:
# a session-level advisory lock lets one migrate while the others wait, then find nothing to do.
MIGRATION_LOCK = 0x10AA_F1E5


def run_migrations(connection: sa.Connection) -> None:
    if connection.dialect.name == "postgresql":
        connection.exec_driver_sql(f"SELECT pg_advisory_lock({MIGRATION_LOCK})")
        connection.commit()  # the lock outlives the transaction; Alembic begins its own
        try:
            _run_migrations(connection)
        finally:
            connection.exec_driver_sql(f"SELECT pg_advisory_unlock({MIGRATION_LOCK})")
            connection.commit()
        return
    _run_migrations(connection)


def _run_migrations(connection: sa.Connection) -> None:
    sqlite = connection.dialect.name == "sqlite"
    if sqlite:
        # A batch rebuild drops and recreates a table; with foreign keys enforced that drop would
        # cascade or fail. SQLite's documented recipe: switch them off meanwhile (outside any
        # transaction: the commit ends the one SQLAlchemy began, which Alembic would otherwise take
        # for the caller's and never commit), check afterwards, switch them back on.
        connection.exec_driver_sql("PRAGMA foreign_keys=OFF")
        connection.commit()
    context.configure(connection=connection, **configure_options(connection.dialect.name))
    with context.begin_transaction():
        context.run_migrations()
    if sqlite:
        violations = connection.exec_driver_sql("PRAGMA foreign_key_check").fetchall()
        if violations:
            raise RuntimeError(f"foreign key violations after migrating: {violations}")
        connection.exec_driver_sql("PRAGMA foreign_keys=ON")
        connection.commit()


def run_migrations_online() -> None:
    # A caller's connection (db.session.upgrade_to_head given an engine, e.g. in-memory SQLite).
    if (connection := config.attributes.get("connection")) is not None:
        run_migrations(connection)
        return
    engine = make_engine(database_url())
    try:
        with engine.connect() as connection:
            run_migrations(connection)
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()

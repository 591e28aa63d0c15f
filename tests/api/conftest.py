"""The API app alone, in this process: SQLite in a temporary folder, no scheduler loop and no engine
behind it. Requests the API accepts are stored and handed to `RecordingScheduler`, which only keeps
them; a test that needs an outcome writes it into the request's row, as the scheduler would."""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from api.app import create_app
from api.served_models import ServedModel, ServedModels
from db.session import make_engine, make_session_factory, upgrade_to_head
from db.tenants import create_tenant
from messaging.notify import Notifier
from models.registry import model_info
from service.settings import Settings


@dataclass
class RecordingScheduler:
    submitted: list = field(default_factory=list)

    def submit(self, queued) -> None:
        self.submitted.append(queued)


@dataclass
class Api:
    """A client of the app and what stands behind it. `key(name)` makes a tenant and returns its key."""

    client: TestClient
    app: object
    scheduler: RecordingScheduler
    sessions: object

    def key(self, name: str) -> str:
        with self.sessions() as s:
            return create_tenant(s, name)[1]

    def as_tenant(self, key: str) -> TestClient:
        return TestClient(self.app, base_url="http://test/api/v1", headers={"X-API-Key": key})


@pytest.fixture(scope="session")
def tiny_info():
    return model_info("tiny")


@pytest.fixture(scope="session")
def migrated_database(tmp_path_factory) -> Path:
    """A SQLite database at the migrations' head, made once: each test starts from a copy (running the
    migrations took ~0.5 s a test)."""
    path = tmp_path_factory.mktemp("migrated") / "loraplex.db"
    upgrade_to_head(f"sqlite:///{path}")
    return path


@pytest.fixture
def api(tmp_path, tiny_info, migrated_database) -> Api:
    settings = Settings(data_dir=tmp_path, base_model="tiny", long_poll_seconds=0.3, sampler_enabled=False)
    shutil.copyfile(migrated_database, tmp_path / "loraplex.db")  # the database settings.resolved_database_url names
    sessions = make_session_factory(make_engine(settings.resolved_database_url))
    scheduler = RecordingScheduler()
    app = create_app(settings=settings, sessions_factory=sessions, notifier=Notifier(),
                     models=ServedModels([ServedModel(tiny_info, scheduler)]))
    with TestClient(app, base_url="http://test/api/v1") as client:
        yield Api(client, app, scheduler, sessions)

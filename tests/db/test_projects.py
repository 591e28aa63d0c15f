"""Projects are a tenant's own, by the schema itself; files shared by a copy outlive its source."""

from __future__ import annotations

from pathlib import Path

import pytest
import sqlalchemy as sa

from db import projects
from db.checkpoints import delete_checkpoint
from db.models import Checkpoint, ClientSession, Project, Tenant, TrainingModel
from db.session import make_engine, make_session_factory, upgrade_to_head


@pytest.fixture
def db(tmp_path):
    url = f"sqlite:///{tmp_path / 'loraplex.db'}"
    upgrade_to_head(url)
    engine = make_engine(url)
    with make_session_factory(engine)() as session:
        yield session
    engine.dispose()


def tenants(db, *names: str) -> list[Tenant]:
    rows = [Tenant(name=name) for name in names]
    db.add_all(rows)
    db.flush()
    return rows


def test_a_project_is_made_once_and_belongs_to_its_tenant(db):
    alice, bob = tenants(db, "alice", "bob")
    assert projects.ensure(db, alice.id, "archive") is True
    assert projects.ensure(db, alice.id, "archive") is False  # the second use finds it
    assert projects.ensure(db, bob.id, "archive") is True  # bob's own project of the same name
    assert sorted(tuple(row) for row in db.execute(sa.select(Project.tenant_id, Project.id))) == \
        sorted([(alice.id, "archive"), (bob.id, "archive")])
    with pytest.raises(ValueError, match="a project name is"):
        projects.ensure(db, alice.id, "has spaces")
    db.commit()

    projects.ensure(db, alice.id, "only-alice")
    db.add(ClientSession(tenant_id=bob.id, project_id="only-alice", tags=[], user_metadata={}))
    with pytest.raises(sa.exc.IntegrityError, match="(?i)foreign key"):
        db.commit()  # bob's session cannot be filed under alice's project, whatever a route does


def test_files_a_copy_shares_are_deleted_with_the_last_checkpoint_using_them(db, tmp_path):
    (alice,) = tenants(db, "alice")
    session = ClientSession(tenant_id=alice.id, tags=[], user_metadata={})
    db.add(session)
    db.flush()
    for run in ("r0", "r1"):
        db.add(TrainingModel(id=f"{session.id}:train:{run}", tenant_id=alice.id, session_id=session.id,
                             base_model="tiny", lora_config={"rank": 4}, user_metadata={}))
    db.flush()
    folders = {}
    for kind, dir_kind, leaf in (("training_state", "weights", "s"), ("sampler", "sampler_weights", "w/seq-3")):
        folder = tmp_path / "ckpt" / dir_kind / leaf
        folder.mkdir(parents=True)
        (folder / "adapter.safetensors").write_bytes(b"x")
        folders[kind] = folder
        for run in ("r0", "r1"):  # the source and its copy, one storage path
            db.add(Checkpoint(tenant_id=alice.id, model_id=f"{session.id}:train:{run}", kind=kind, name=leaf[:1],
                              tinker_path=f"tinker://{session.id}:train:{run}/{dir_kind}/{leaf[:1]}",
                              storage_path=str(folder), size_bytes=1))
    db.commit()

    for source in db.scalars(sa.select(Checkpoint).where(Checkpoint.model_id.endswith(":train:r0"))).all():
        delete_checkpoint(db, source)
    db.commit()
    assert all(Path(folder, "adapter.safetensors").exists() for folder in folders.values())
    for copy in db.scalars(sa.select(Checkpoint)).all():
        delete_checkpoint(db, copy)
    db.commit()
    assert not folders["training_state"].exists()
    assert not folders["sampler"].parent.exists()  # a sampler checkpoint's root: every version's folder

"""What the authorization matrix acts on: five callers (the owner, another tenant, no key, the
owner's revoked key, a disabled tenant's key) and the owner's resources of every kind a route can
name: sessions, a trained model, training and sampler checkpoints, a sampler, a finished request,
trajectories of the rollout store (one sampled from the model's snapshot, as the dashboard shows
a run's), a client metric logged on the model.

Tenants and keys come from db/tenants.py; revoking a key and disabling a tenant go through
`loraplex-admin` (admin/cli.py), the operator's commands, since db/tenants.py has no function
for either.
"""

from __future__ import annotations

import itertools
import uuid
from dataclasses import dataclass, fields, replace

from typer.testing import CliRunner

from admin.cli import app as admin_app
from db import rollouts
from db.models import new_id
from db.tenants import create_tenant, issue_key
from tests.reliability.client import Api

IDENTITIES = ("none", "revoked", "disabled", "other", "owner")  # the owner last: its calls may change state


@dataclass(frozen=True)
class Ids:
    """The owner's resource ids, by name."""

    session: str
    spare_session: str  # finished by the matrix
    model: str
    request: str  # a finished forward_backward
    checkpoint: str  # tinker://<model>/weights/c1
    publish_checkpoint: str  # published and unpublished by the matrix
    delete_checkpoint: str  # deleted by the matrix
    sampler_weights: str  # tinker://<model>/sampler_weights/sw
    sampler: str
    trajectory: str  # a rollout-store trajectory (session id) with a reward
    delete_trajectory: str  # deleted by the matrix
    run_trajectory: str  # a trajectory sampled from sampler_weights (the model's snapshot at step 1)

    def missing(self) -> "Ids":
        """Ids of the same form that name nothing: another tenant must not tell them from ours."""
        session, spare = new_id(), new_id()
        model = f"{session}:train:0"
        return Ids(session=session, spare_session=spare, model=model, request=new_id(),
                   checkpoint=f"tinker://{model}/weights/c1", publish_checkpoint=f"tinker://{model}/weights/pub",
                   delete_checkpoint=f"tinker://{model}/weights/del",
                   sampler_weights=f"tinker://{model}/sampler_weights/sw", sampler=f"{session}:sample:0",
                   trajectory=new_id(), delete_trajectory=new_id(), run_trajectory=new_id())

    def normalize(self, text: str) -> str:
        """`text` with every id replaced by its name (longest first: a model id holds its session id)."""
        for name, value in sorted(((f.name, getattr(self, f.name)) for f in fields(self)), key=lambda p: -len(p[1])):
            text = text.replace(value, f"<{name}>")
        return text

    def values(self) -> list[str]:
        return [getattr(self, f.name) for f in fields(self)]


@dataclass
class World:
    base_url: str
    keys: dict[str, str | None]  # identity -> API key
    ids: Ids
    owner_tenant_id: str
    seq: itertools.count  # the owner model's next seq ids (the matrix's requests take them)

    def api(self, identity: str) -> Api:
        return Api(self.base_url, self.keys[identity])

    def with_ids(self, ids: Ids) -> "World":
        return replace(self, ids=ids)


def admin(data_dir, *args: str) -> str:
    """`loraplex-admin ARGS` on the server's database, asserting success."""
    result = CliRunner().invoke(admin_app, list(args), env={"LORAPLEX_DATA_DIR": str(data_dir), "COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    return result.output


def build_world(server) -> World:
    """Tenants, keys and the owner's resources on `server` (a ServerThread), over HTTP."""
    suffix = uuid.uuid4().hex[:6]
    with server.embedded.sessions() as s:
        owner, owner_key = create_tenant(s, f"owner-{suffix}")
        revoked_key = issue_key(s, owner)
        _, other_key = create_tenant(s, f"other-{suffix}")
        _, disabled_key = create_tenant(s, f"disabled-{suffix}")
        owner_id = owner.id
    admin(server.settings.data_dir, "keys", "revoke", revoked_key[:12])
    admin(server.settings.data_dir, "tenants", "disable", f"disabled-{suffix}")

    api = Api(server.base_url, owner_key)
    session, spare = api.new_session(), api.new_session()
    model = api.create_model(session)
    request = api.forward_backward(model, 1)
    pending = [request, api.optim_step(model, 2)]
    for seq, name in ((3, "c1"), (4, "pub"), (5, "del")):
        pending.append(api.accept("save_weights", json={"model_id": model, "seq_id": seq, "path": name}))
    pending.append(api.accept("save_weights_for_sampler", json={"model_id": model, "seq_id": 6, "path": "sw"}))
    for request_id in pending:
        api.result(request_id)
    sampler_weights = f"tinker://{model}/sampler_weights/sw"
    logged = api.post(f"training_runs/{model}/metrics", json={"metrics": {"eval/accuracy": 0.5}, "step": 1})
    assert logged.status_code == 200, logged.text
    created = api.post("create_sampling_session", json={"session_id": session, "sampling_session_seq_id": 0,
                                                        "model_path": sampler_weights})
    assert created.status_code == 200, created.text
    api.close()
    ids = Ids(session=session, spare_session=spare, model=model, request=request,
              checkpoint=f"tinker://{model}/weights/c1", publish_checkpoint=f"tinker://{model}/weights/pub",
              delete_checkpoint=f"tinker://{model}/weights/del", sampler_weights=sampler_weights,
              sampler=created.json()["sampling_session_id"], trajectory=_trajectory(server, owner_id, reward=1.0),
              delete_trajectory=_trajectory(server, owner_id),
              run_trajectory=_trajectory(server, owner_id, reward=0.5, sampler_path=sampler_weights))
    keys = {"owner": owner_key, "other": other_key, "none": None, "revoked": revoked_key, "disabled": disabled_key}
    return World(server.base_url, keys, ids, owner_id, itertools.count(7))


def _trajectory(server, tenant_id: str, reward: float | None = None, sampler_path: str | None = None) -> str:
    """A one-turn trajectory in the owner's rollout store, written as the inference API writes one
    (no sampler needed: the matrix's own calls of those routes record more); with `sampler_path`, as
    sampled from that snapshot of the model (at step 1, after the world's optim_step)."""
    turn = rollouts.NewTurn(id=new_id(), api="completions", model=sampler_path or "tiny", sampler_path=sampler_path,
                            adapter_path=None, policy_version=1 if sampler_path else None, request_id=new_id(),
                            prompt=[5, 6, 7],
                            choices=[rollouts.SampledChoice([8, 9], [-1.0, -2.0], "length")],
                            request_body={"model": "tiny", "prompt": [5, 6, 7]}, response_body={})
    session_id, _ = rollouts.record_turn(server.embedded.sessions, tenant_id, None, turn)
    if reward is not None:
        with server.embedded.sessions() as s:
            rollouts.set_reward(s, tenant_id, session_id, reward, None, None)
    return session_id

"""The hand-written bad-input corpus (tests/reliability/attacks.py) against a real embedded server.

Each request must get a 4xx (never a 5xx) whose short error names the field, shows no server path,
and echoes no input; a bystander tenant must be served promptly right after; and a refused request
that carried a readable (model_id, seq_id) must not hold up the model's next seq_id (the
scheduler would otherwise wait LORAPLEX_SEQ_GAP_SECONDS, 60 s, for it).
"""

from __future__ import annotations

import itertools
import shutil
from dataclasses import dataclass

import httpx
import pytest

from db.models import Checkpoint
from tests.reliability.attacks import JSON_ATTACKS, PROTOBUF_ATTACKS, SAMPLE_ATTACKS, Attack, Target
from tests.reliability.checks import Bystander, assert_refused, refusal_problems
from tests.reliability.client import Api, checkpoint_url, send
from tests.servers import running_server

pytestmark = pytest.mark.slow  # ~70 attacks, a bystander's checks after each
PROBE_SECONDS = 10.0  # a forward on the tiny model takes milliseconds; a stalled seq_id waits 60 s


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with running_server(tmp_path_factory.mktemp("bad-input"), sampler_enabled=False) as running:
        yield running


@pytest.fixture(scope="module")
def sampling_server(tmp_path_factory):
    """For the asample attacks only (vLLM: ~15 s to start, one engine per process)."""
    with running_server(tmp_path_factory.mktemp("bad-sampling")) as running:
        yield running


@dataclass
class Attacker:
    key: str
    api: Api
    session_id: str
    checkpoint: str  # a saved training checkpoint of the attacker's first model
    sampler: str  # a sampling session on the base model
    models: itertools.count

    def target(self) -> Target:
        """A fresh model per attack, so that one refusal that stalls its model stalls no other case."""
        model_id = self.api.create_model(self.session_id, next(self.models))
        return Target(model_id, 1, self.session_id, self.checkpoint, self.sampler)


def new_attacker(server) -> Attacker:
    key = server.new_tenant()
    api = Api(server.base_url, key)
    session = api.new_session()
    model = api.create_model(session)
    api.result(api.accept("save_weights", json={"model_id": model, "seq_id": 1, "path": "base"}))
    sampler = api.post("create_sampling_session", json={"session_id": session, "sampling_session_seq_id": 0,
                                                        "base_model": "tiny"}).json()["sampling_session_id"]
    return Attacker(key, api, session, f"tinker://{model}/weights/base", sampler, itertools.count(1))


@pytest.fixture(scope="module")
def attacker(server) -> Attacker:
    return new_attacker(server)


@pytest.fixture(scope="module")
def bystander(server) -> Bystander:
    return Bystander(server.base_url, server.new_tenant())


@pytest.fixture(scope="module")
def sampling_actors(sampling_server) -> tuple[Attacker, Bystander]:
    return new_attacker(sampling_server), Bystander(sampling_server.base_url, sampling_server.new_tenant())


def server_paths(server) -> tuple[str, ...]:
    return str(server.settings.data_dir), str(server.settings.data_dir.resolve())


def problems_after(attack: Attack, response: httpx.Response, target: Target, server, attacker, bystander) -> list[str]:
    """Everything wrong with one attack's outcome, all of it (so one run tells the whole story)."""
    problems = refusal_problems(response, attack.fields, server_paths(server))
    try:
        bystander.check()
    except AssertionError as e:
        problems.append(f"bystander: {e}")
    if attack.uses_seq:  # the refused request used its seq_id: the next one must run at once
        try:
            probe = attacker.api.forward_backward(target.model_id, target.seq_id + 1, forward_only=True)
            attacker.api.result(probe, PROBE_SECONDS)
        except AssertionError as e:
            problems.append(f"the model's next seq_id did not run within {PROBE_SECONDS:.0f} s: {str(e)[:200]}")
    return problems


@pytest.mark.parametrize("attack", PROTOBUF_ATTACKS + JSON_ATTACKS, ids=lambda attack: attack.name)
def test_bad_input_is_refused_clearly_and_harms_nobody(attack, server, attacker, bystander):
    target = attacker.target()
    response = send(server.base_url, attacker.key, attack.build(target))
    problems = problems_after(attack, response, target, server, attacker, bystander)
    assert not problems, f"{'; '.join(problems)} -- answer: {response.status_code} {response.text[:300]!r}"


@pytest.mark.vllm  # sampling_server runs the vLLM sampler
@pytest.mark.parametrize("attack", SAMPLE_ATTACKS, ids=lambda attack: attack.name)
def test_bad_sampling_input_is_refused_clearly_and_harms_nobody(attack, sampling_server, sampling_actors):
    attacker, bystander = sampling_actors
    target = attacker.target()
    response = send(sampling_server.base_url, attacker.key, attack.build(target))
    problems = problems_after(attack, response, target, sampling_server, attacker, bystander)
    assert not problems, f"{'; '.join(problems)} -- answer: {response.status_code} {response.text[:300]!r}"


def test_an_unreadable_checkpoint_does_not_show_where_it_was(server, attacker):
    """The archive of a checkpoint whose files went missing: 404 naming the checkpoint, not the server's path."""
    api = attacker.api
    model = api.create_model(attacker.session_id, 900)
    api.result(api.accept("save_weights", json={"model_id": model, "seq_id": 1, "path": "gone"}))
    path = f"tinker://{model}/weights/gone"
    with server.embedded.sessions() as s:
        storage = s.query(Checkpoint).filter_by(tinker_path=path).one().storage_path
    shutil.rmtree(storage)
    response = api.http.get(checkpoint_url(path, "/archive").removeprefix("/api/v1"))
    assert response.status_code == 404, response.text[:300]
    assert_refused(response, ("checkpoint_id",), server_paths(server))

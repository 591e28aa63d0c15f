"""Every route of the app x every kind of caller, generated from the app's own route table.

The owner is served; another tenant gets 404 worded exactly as for an id that exists nowhere (so
a 404 tells nothing about other tenants' ids); no key, a revoked key and a disabled tenant's key
get 401, worded as for a key never issued; both refusals are short (an HTML page's: its login form
or its empty shell, `Example.refusal_bytes`). Public routes (bootstrap, documentation, metrics) are
declared so in the table. A route without an example request in tests/reliability/examples.py
fails here.
"""

from __future__ import annotations

import secrets

import pytest

from tests.reliability.client import send
from tests.reliability.examples import EXAMPLES, OWNED, PUBLIC, TENANT, bare_app, call_of, route_table
from tests.reliability.world import IDENTITIES, World, build_world
from tests.servers import running_server

pytestmark = pytest.mark.slow  # 226 calls against a server
ROUTES = route_table(bare_app())


def cases():
    for route in ROUTES:
        example = EXAMPLES.get(route)
        marks = [pytest.mark.vllm] if example is not None and example.needs_sampler else []
        for identity in IDENTITIES:
            yield pytest.param(route, identity, id=f"{route[0]} {route[1]} [{identity}]", marks=marks)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with running_server(tmp_path_factory.mktemp("matrix"), sampler_enabled=False) as running:
        yield running


@pytest.fixture(scope="module")
def sampling_server(tmp_path_factory):
    """Only the routes that sample start it (vLLM: one engine per process, ~15 s to start)."""
    with running_server(tmp_path_factory.mktemp("matrix-sampling")) as running:
        yield running


@pytest.fixture(scope="module")
def world_of():
    """One world per server, built on first use; route seq ids reserved once per route."""
    worlds: dict[int, World] = {}
    seqs: dict[tuple[int, tuple[str, str]], int] = {}

    def get(server, route) -> tuple[World, int]:
        if id(server) not in worlds:
            worlds[id(server)] = build_world(server)
        world = worlds[id(server)]
        key = (id(server), route)
        if key not in seqs:  # every caller of a route sends the same seq id: only the owner's is accepted
            seqs[key] = next(world.seq)
        return world, seqs[key]
    return get


def test_the_running_servers_routes_are_the_ones_checked(server):
    assert sorted(route_table(server.embedded.app)) == sorted(ROUTES)


@pytest.mark.parametrize("route, identity", list(cases()))
def test_access(route, identity, request, world_of):
    example = EXAMPLES.get(route)
    assert example is not None, f"no example request for {route}: add one to EXAMPLES in tests/reliability/examples.py"
    server = request.getfixturevalue("sampling_server" if example.needs_sampler else "server")
    world, seq = world_of(server, route)
    response = send(world.base_url, world.keys[identity], call_of(route, example, world, seq))
    seen = f"{response.status_code} {response.text[:300]!r}"

    if example.access == PUBLIC:  # bootstrap and documentation: no tenant's data in them
        assert response.status_code in example.owner_status, seen
        return
    if identity in ("none", "revoked", "disabled"):
        assert response.status_code == 401, seen
        assert len(response.content) < example.refusal_bytes, seen
        if identity != "none":  # a revoked or disabled key reads exactly like a key never issued
            unknown = send(world.base_url, f"tml-{secrets.token_urlsafe(32)}", call_of(route, example, world, seq))
            assert (unknown.status_code, unknown.text) == (response.status_code, response.text)
        return
    if identity == "owner":
        assert response.status_code in example.owner_status, seen
        return
    if example.access == TENANT:  # served, on the caller's own data: none of the owner's ids in it
        assert response.status_code in example.owner_status, seen
        leaked = [value for value in [*world.ids.values(), world.owner_tenant_id] if value in response.text]
        assert not leaked, f"another tenant's response names the owner's {leaked}"
        return
    assert example.access == OWNED
    assert response.status_code in example.other_status, seen
    missing = world.with_ids(world.ids.missing())
    twin = send(missing.base_url, world.keys["other"], call_of(route, example, missing, seq))
    assert twin.status_code == response.status_code, f"{twin.status_code} {twin.text[:300]!r}"
    assert world.ids.normalize(response.text) == missing.ids.normalize(twin.text), \
        "another tenant's id and an id that exists nowhere must read the same"
    assert len(response.content) < example.refusal_bytes, seen

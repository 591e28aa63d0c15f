"""Bad input generated from the app's own OpenAPI schema by schemathesis, for every operation.

Each operation gets requests that break its schema (wrong types, missing fields, values out of
range, bodies that are not JSON) and a few that follow it with arbitrary values, sent with a live
key so they get past authentication to validation. Every answer must be below 500, and a refusal
short with no server path; a bystander tenant's get_info must answer within 2 s after each one,
and its forward after each operation. Which field a generated request spoils is not known here,
so naming the field is checked by the hand-written corpus (test_bad_input.py).

Bounded: a few examples per operation, derandomized (the same requests every run), no shrinking.
"""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode

from tests.reliability.attacks import JSON_ATTACKS, PROTOBUF_ATTACKS
from tests.reliability.checks import Bystander, refusal_problems
from tests.reliability.examples import bare_app
from tests.servers import running_server

pytestmark = pytest.mark.slow  # ~130 generated requests, a bystander's checks after each
OPENAPI = bare_app().openapi()
SCHEMA = schemathesis.openapi.from_dict(OPENAPI)
OPERATIONS = [result.ok() for result in SCHEMA.get_all_operations()]
PER_OPERATION = {GenerationMode.NEGATIVE: 4, GenerationMode.POSITIVE: 2}
CORPUS_SIZE = 100  # generated and hand-written requests together, at least


def draw(operation, mode: GenerationMode, n: int) -> list:
    cases = []

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(max_examples=n, derandomize=True, database=None, deadline=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    def collect(case) -> None:
        cases.append(case)

    try:
        collect()
    except Unsatisfiable:  # nothing of this operation can be spoiled: no body, no query, a path parameter only
        pass
    return cases


def spoilable(operation) -> bool:
    """Whether the operation has a body or a query parameter, the only parts a NEGATIVE case can break
    here: a path parameter or header is any string. For the others hypothesis searches in vain (2-8 s
    per operation on 2 cores, half the module's time) before it gives up."""
    spec = OPENAPI["paths"][operation.path][operation.method.lower()]
    return "requestBody" in spec or any(p["in"] == "query" for p in spec.get("parameters", ()))


@pytest.fixture(scope="module")
def generated() -> dict[str, list]:
    return {op.label: [case for mode, n in PER_OPERATION.items() if mode is GenerationMode.POSITIVE or spoilable(op)
                       for case in draw(op, mode, n)] for op in OPERATIONS}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with running_server(tmp_path_factory.mktemp("fuzz"), sampler_enabled=False) as running:
        yield running


@pytest.fixture(scope="module")
def bystander(server) -> Bystander:
    return Bystander(server.base_url, server.new_tenant())


def test_the_corpus_holds_at_least_100_requests(generated):
    total = sum(map(len, generated.values())) + len(PROTOBUF_ATTACKS) + len(JSON_ATTACKS)
    assert total >= CORPUS_SIZE, total


@pytest.mark.parametrize("operation", OPERATIONS, ids=lambda op: op.label)
def test_generated_requests_get_no_server_error(operation, generated, server, bystander):
    key = server.new_tenant()
    data_dir = (str(server.settings.data_dir), str(server.settings.data_dir.resolve()))
    problems = []
    for case in generated[operation.label]:
        case.headers = {k: v for k, v in (case.headers or {}).items() if k.lower() != "x-api-key"} | {"X-API-Key": key}
        response = case.call(base_url=server.base_url, timeout=30)
        if response.status_code >= 400 or response.status_code < 200:
            found = refusal_problems(response, (), data_dir)
        else:
            found = []
        if found:
            problems.append(f"{'; '.join(found)}: {response.status_code} {response.content[:200]!r} "
                            f"<- {case.as_curl_command()[:300]}")
        try:
            bystander.check_info()
        except AssertionError as e:
            problems.append(f"after {case.as_curl_command()[:200]}: {e}")
    bystander.check_forward()
    assert not problems, "\n".join(problems)

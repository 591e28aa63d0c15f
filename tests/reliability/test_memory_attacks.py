"""Large bodies without an API key must cost the server next to no memory.

Against `python -m service serve` in a process of its own (so its RSS is its alone): three
concurrent chunked uploads of 300 MB (Transfer-Encoding: chunked, no Content-Length, so no size
to refuse up front) to forward_backward and to optim_step, and a 60 MB text/plain body with a
Content-Length under the 64 MiB limit to optim_step. Each must get 401 (no key) or 413 with a
body of a few hundred bytes, and the server's RSS must grow by less than GROWTH_BOUND and come
back to within SETTLED_BOUND of where it was.

The bounds: a caller without a key must not make the server hold its body, only a bounded
prefix (read to find out who is calling) and per-connection buffers, well under a megabyte per
upload. 100 MB is a third of one attacking body, and below the 3 x 64 MiB a server would hold
if it buffered each body up to its size limit before refusing it; the RSS of this server
(torch, the tiny model, SQLite) moves by a few MB between idle requests.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import httpx
import pytest

from service.embedded import free_port
from tests.reliability.processes import RssSampler, rss_bytes, start_serve, stop, tenant_key
from tests.reliability.raw_http import upload
from tests.waiting import wait_until

pytestmark = pytest.mark.slow  # `python -m service serve` in a process of its own, 300 MB uploads
MB = 1 << 20
UPLOAD_BYTES = 300 * MB
GROWTH_BOUND = 100 * MB
SETTLED_BOUND = 30 * MB
SMALL_ANSWER = 4096
ATTACKS = {  # route -> (content type, what the body starts with)
    "forward_backward": ("application/x-protobuf", b"\x0a\x05model\x10\x01"),
    "optim_step": ("application/json", b'{"model_id": "'),
}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    data_dir, port = tmp_path_factory.mktemp("memory"), free_port()
    process = start_serve(data_dir, port)
    key = tenant_key(data_dir, "bystander")
    try:
        yield SimpleNamespace(process=process, port=port, base_url=f"http://127.0.0.1:{port}", key=key)
    finally:
        stop(process)


def settled_rss(server) -> int:
    """RSS once a few ordinary requests have been served (connections and caches warmed up) and it
    stopped moving: five readings 0.1 s apart within 1 MB of each other."""
    for _ in range(5):
        httpx.get(f"{server.base_url}/api/v1/sessions", headers={"X-API-Key": server.key}, timeout=10)
    readings: list[int] = []

    def steady() -> int:
        readings.append(rss_bytes(server.process.pid))
        recent = readings[-5:]
        return recent[-1] if len(recent) == 5 and max(recent) - min(recent) < MB else 0

    return wait_until(steady, lambda: f"the server's RSS to settle (last readings, MB: "
                      f"{[round(r / MB) for r in readings[-5:]]})", timeout=60, interval=0.1)


def bystander_is_served(server) -> float:
    start = time.monotonic()
    response = httpx.get(f"{server.base_url}/api/v1/sessions", headers={"X-API-Key": server.key}, timeout=10)
    assert response.status_code == 200, response.text[:300]
    return time.monotonic() - start


def check(server, answers, baseline: int, peak: int) -> None:
    seen = [(a.status, a.body[:200], f"{a.sent / MB:.0f} MB sent in {a.seconds:.1f} s") for a in answers]
    assert all(a.status in (401, 413) for a in answers), seen
    assert all(len(a.body) < SMALL_ANSWER for a in answers), seen
    assert peak - baseline < GROWTH_BOUND, f"RSS grew by {(peak - baseline) / MB:.0f} MB: {seen}"
    above = lambda: rss_bytes(server.process.pid) - baseline
    wait_until(lambda: above() < SETTLED_BOUND, lambda: f"RSS to come back within {SETTLED_BOUND // MB} MB of its "
               f"baseline (still {above() / MB:.0f} MB above)", timeout=10)
    assert bystander_is_served(server) < 2.0


@pytest.mark.parametrize("route", list(ATTACKS))
def test_three_chunked_300_mb_uploads_without_a_key(server, route):
    content_type, prefix = ATTACKS[route]
    baseline = settled_rss(server)
    with RssSampler(server.process.pid) as rss, ThreadPoolExecutor(3) as pool:
        answers = list(pool.map(lambda _: upload(server.port, f"/api/v1/{route}", {"Content-Type": content_type},
                                                 UPLOAD_BYTES, chunked=True, prefix=prefix), range(3)))
    check(server, answers, baseline, rss.peak)


def test_a_60_mb_text_body_without_a_key(server):
    baseline = settled_rss(server)
    with RssSampler(server.process.pid) as rss:
        answer = upload(server.port, "/api/v1/optim_step", {"Content-Type": "text/plain"}, 60 * MB, chunked=False,
                        prefix=b'{"model_id": "')
    check(server, [answer], baseline, rss.peak)

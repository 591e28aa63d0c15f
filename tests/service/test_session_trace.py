"""The official SDK's export_session_trace against a real embedded server: the session's Perfetto trace,
read back with the `perfetto` package's protobuf classes, shows every request of the session, the cycles
it shared with another tenant as counts, and nothing of that tenant's own."""

from __future__ import annotations

import threading
import urllib.error
import urllib.request

import numpy as np
import pytest
import sqlalchemy as sa
import tinker
from tinker import types

from db.models import Request
from tests.perfetto_view import read_trace

pytestmark = pytest.mark.slow  # two servers (SQLite; Postgres with the engine in a child process)
VOCAB = 512


def sft(seed: int, n: int = 3, length: int = 10) -> list[types.Datum]:
    rng = np.random.default_rng(seed)
    data = []
    for _ in range(n):
        seq = rng.integers(0, VOCAB, length + 1)
        data.append(types.Datum(model_input=types.ModelInput.from_ints(seq[:-1].tolist()),
                                loss_fn_inputs={"target_tokens": seq[1:].astype(np.int64),
                                                "weights": np.ones(length, dtype=np.float32)}))
    return data


def test_a_session_trace_shows_each_request_its_cycle_and_nobody_elses(server):
    keys = [server.new_tenant() for _ in range(2)]
    mine, theirs = (tinker.ServiceClient(base_url=server.base_url, api_key=key) for key in keys)
    trainers = [c.create_lora_training_client(base_model="tiny", rank=4, seed=1).result() for c in (mine, theirs)]
    threads = [threading.Thread(target=lambda t=t, i=i: t.forward_backward(sft(i), "cross_entropy").result())
               for i, t in enumerate(trainers)]
    for t in threads:  # together: the scheduler gathers them into one cycle (cycle_gather_seconds)
        t.start()
    for t in threads:
        t.join()
    trainers[0].optim_step(types.AdamParams(learning_rate=1e-3)).result()
    trainers[0].forward_backward(sft(2), "cross_entropy").result()
    session_id = mine.holder.get_session_id()

    with server.embedded.sessions() as s:
        rows = {r.id: r for r in s.scalars(sa.select(Request).where(Request.model_id == trainers[0].model_id))}
        other_ids = set(s.scalars(sa.select(Request.id).where(Request.model_id == trainers[1].model_id)))
        other_tenant = s.scalar(sa.select(Request.tenant_id).where(Request.model_id == trainers[1].model_id))
    assert len(rows) == 4  # create_model, forward_backward, optim_step, forward_backward
    shared = next(r for r in rows.values() if r.kind == "forward_backward" and r.seq_id == 1)
    together = [c for c in server.embedded.scheduler.cycle_log.cycles if shared.id in c and other_ids & set(c)]
    assert together, "both tenants' first forward_backward ran in one engine call"

    with pytest.raises(tinker.NotFoundError, match="session_id"):  # another tenant's session: as if none
        tinker.RestClient(base_url=server.base_url, api_key=keys[1]).export_session_trace(session_id).result()
    url = tinker.RestClient(base_url=server.base_url, api_key=keys[0]).export_session_trace(session_id).result()
    raw, trace = read_trace(url)

    # nothing of the other tenant's: not its tenant, session, run or requests
    for secret in [other_tenant, theirs.holder.get_session_id(), trainers[1].model_id, *other_ids]:
        assert secret.encode() not in raw
    requests = {s["args"]["request_id"]: s for s in trace.slices if "request_id" in s["args"]}
    assert set(requests) == set(rows)  # one span per request of the session
    for request_id, row in rows.items():
        span = requests[request_id]
        assert trace.lane_of(span) == trainers[0].model_id
        assert span["name"] == f"{row.kind} #{row.seq_id}" and span["args"]["state"] == "done"
        assert span["args"]["input_tokens"] == row.num_tokens
        children = [s for s in trace.slices if s["track"] == span["track"] and s["parent"] == span["name"]]
        assert [c["name"] for c in children] == ["queued", "compute"]
        queued, compute = children
        assert span["start"] == queued["start"] <= queued["end"] == compute["start"] <= compute["end"] == span["end"]

    # the shared forward_backward's compute points (a flow) at its cycle, which counts both tenants, unnamed
    compute = next(s for s in trace.slices if s["name"] == "compute" and s["track"] == requests[shared.id]["track"])
    (cycle,) = [s for s in trace.slices if s["name"] == "cycle" and compute["flows"][0] in s["ends_flows"]]
    assert cycle["args"]["tenants"] == requests[shared.id]["args"]["cycle_tenants"] == 2
    assert cycle["args"]["other_tenants"] == 1 and cycle["args"]["own_requests"] == 1
    assert cycle["args"]["requests"] == requests[shared.id]["args"]["cycle_requests"] >= 2
    assert cycle["start"] == compute["start"]

    # counters: requests queued and running over time, and tokens per second that add up to those trained
    assert max(v for _, v in trace.counters["requests running"]) >= 1
    assert trace.counters["requests queued"][-1][1] == trace.counters["requests running"][-1][1] == 0
    points = trace.counters["trained tokens/s"]
    tokens = sum(v * (t2 - t1) / 1e9 for (t1, v), (t2, _) in zip(points, points[1:]))
    assert tokens == pytest.approx(sum(r.num_tokens for r in rows.values() if r.kind == "forward_backward"))

    # the URL is the credential: changed in any part, it is refused
    for bad in (url.replace("signature=", "signature=0"), url.replace(session_id, theirs.holder.get_session_id()),
                url.split("?")[0]):
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(bad, timeout=60)
        assert refused.value.code == 403


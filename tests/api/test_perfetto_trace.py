"""A session's timeline as a Perfetto trace (api/perfetto_trace.py), read back with the `perfetto`
package's protobuf classes: requests in every state, samples, and the cycles shared with others."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from perfetto.protos.perfetto.trace.perfetto_trace_pb2 import Trace

from api.perfetto_trace import ns, session_trace
from db.session_timeline import Cycle, RequestSpan, SessionTimeline
from tests.perfetto_view import TraceView

T0 = datetime(2026, 12, 6, 12, 0, 0, 123456, tzinfo=UTC)
RUN, SAMPLER = "s:train:0", "s:sample:0"


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def span(request_id, kind, seq_id, created, started=None, finished=None, *, model=RUN, state="done", tokens=10,
         output=0, error=None) -> RequestSpan:
    return RequestSpan(request_id, model, seq_id, kind, state, tokens, output, at(created),
                       None if started is None else at(started), None if finished is None else at(finished), error)


def build(requests: list[RequestSpan], cycles: dict, now: float = 60.0) -> TraceView:
    timeline = SessionTimeline("s", T0, None, [RUN], [SAMPLER], requests, cycles)
    return TraceView(Trace.FromString(session_trace(timeline, at(now))))


def by_request(view: TraceView) -> dict[str, dict]:
    return {s["args"]["request_id"]: s for s in view.slices if "request_id" in s["args"]}


def children(view: TraceView, parent: dict) -> list[dict]:
    return [s for s in view.slices if s["track"] == parent["track"] and s["parent"] == parent["name"]]


def test_each_request_is_a_span_of_its_wait_and_its_compute():
    cycle = Cycle(at(2), at(3), requests=5, tenants=3, tokens=400)
    view = build([span("a", "forward_backward", 1, 1, 2, 3, tokens=40),
                  span("b", "optim_step", 2, 1.5, 4, 4, tokens=0, state="failed", error="learning_rate: bad")],
                 {at(2): cycle, at(4): Cycle(at(4), at(4), 1, 1, 0)})
    spans = by_request(view)
    a, b = spans["a"], spans["b"]
    assert a["name"] == "forward_backward #1" and view.lane_of(a) == RUN
    queued, compute = children(view, a)
    assert (queued["name"], queued["start"], queued["end"]) == ("queued", ns(at(1)), ns(at(2)))
    assert (compute["name"], compute["start"], compute["end"]) == ("compute", ns(at(2)), ns(at(3)))
    expected = {"cycle_tenants": 3, "cycle_requests": 5, "cycle_tokens": 400, "input_tokens": 40, "seq_id": 1}
    assert {k: a["args"][k] for k in expected} == expected
    assert b["args"]["state"] == "failed" and b["args"]["error"] == "learning_rate: bad"
    assert [c["end"] - c["start"] for c in children(view, b)] == [ns(at(4)) - ns(at(1.5)), 0]  # an instant compute

    (shared,) = [s for s in view.slices if s["name"] == "cycle" and s["start"] == ns(at(2))]
    assert shared["args"] == {"requests": 5, "tokens": 400, "tenants": 3, "other_tenants": 2, "own_requests": 1,
                              "own_tokens": 40}
    assert compute["flows"] and compute["flows"] == shared["ends_flows"]
    assert shared["end"] == ns(at(3))


def test_unfinished_requests_end_at_the_export_and_samples_have_no_cycle():
    view = build([span("queued", "forward_backward", 1, 10, state="pending", tokens=7),
                  span("sample", "sample", None, 20, None, 22, model=SAMPLER, tokens=5, output=15)], {}, now=30)
    spans = by_request(view)
    (waiting,) = children(view, spans["queued"])
    assert (waiting["name"], waiting["end"], spans["queued"]["end"]) == ("queued", ns(at(30)), ns(at(30)))
    assert spans["queued"]["args"]["state"] == "pending"
    sample = spans["sample"]
    assert sample["name"] == "sample" and view.lane_of(sample) == SAMPLER
    assert [c["name"] for c in children(view, sample)] == ["sampling"]
    assert sample["args"]["output_tokens"] == 15 and "cycle_tenants" not in sample["args"]
    assert not [s for s in view.slices if s["name"] == "cycle"]

    # one queued from 10 s to the export; the sample running from 20 s to 22 s
    assert view.counters["requests queued"] == [(ns(at(10)), 1), (ns(at(30)), 0)]
    assert view.counters["requests running"] == [(ns(at(20)), 1), (ns(at(22)), 0)]
    points = view.counters["sampled tokens/s"]
    assert sum(v * (t2 - t1) / 1e9 for (t1, v), (t2, _) in zip(points, points[1:])) == pytest.approx(20)
    assert "trained tokens/s" not in view.counters  # nothing trained


def test_a_long_session_keeps_its_throughput_counter_small():
    requests = [span(f"r{i}", "forward_backward", i + 1, i * 10.0, i * 10.0, i * 10.0 + 1, tokens=100)
                for i in range(3000)]  # 30,000 s
    view = build(requests, {}, now=30_001)
    points = view.counters["trained tokens/s"]
    assert len(points) <= 502
    assert sum(v * (t2 - t1) / 1e9 for (t1, v), (t2, _) in zip(points, points[1:])) == pytest.approx(300_000)

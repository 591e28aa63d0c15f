"""A session's timeline (db/session_timeline.py) as a Perfetto trace (`.pftrace`: a protobuf `Trace` of
`TracePacket`s holding TrackEvents), written with the `perfetto` package's trace builder and protobuf
classes. ui.perfetto.dev opens it; trace_processor queries it. For users: docs/sessions.md.

    session <id>                      a process track
      <run or sampler id>             one track per training run and sampler of the session
        requests                      one track per request, merged by name into one lane group:
          forward_backward #3         a slice from acceptance to outcome, with the request's numbers
            queued | compute          its wait for the trainer, then its cycle's engine call
      trainer cycles                  one slice per cycle the session's requests ran in: how many
                                      requests, tokens and tenants shared it (counts, no identities);
                                      a flow arrow links each request's compute to its cycle
      requests queued, requests running, trained tokens/s, sampled tokens/s   counter tracks

Timestamps are nanoseconds since the Unix epoch. A request not finished when the trace is built ends
at that moment, its state saying so.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

from perfetto.protos.perfetto.trace.perfetto_trace_pb2 import CounterDescriptor, TrackEvent
from perfetto.trace_builder.proto_builder import TraceProtoBuilder

from contract.kinds import RequestKind
from db.session_timeline import Cycle, RequestSpan, SessionTimeline

MEDIA_TYPE = "application/octet-stream"
SEQUENCE_ID = 1  # every packet comes from one writer
SESSION_PID = 1  # the session's process track; a trace holds one session
THROUGHPUT_POINTS = 500  # at most this many bins on a throughput counter (bins of 1 s or wider)
TRAINED_KINDS = (RequestKind.FORWARD_BACKWARD, RequestKind.FORWARD)
EPOCH = datetime(1970, 1, 1, tzinfo=UTC)

BEGIN, END, COUNTER = TrackEvent.TYPE_SLICE_BEGIN, TrackEvent.TYPE_SLICE_END, TrackEvent.TYPE_COUNTER


def ns(at: datetime) -> int:
    """Exact nanoseconds since the epoch (a float of seconds would round off the microseconds)."""
    return (at - EPOCH) // timedelta(microseconds=1) * 1000


class _Writer:
    """Track descriptors first, then every event in time order. The sort is stable: each track's events
    are added in their own order (a slice's children end before it does), which holds at equal times."""

    def __init__(self) -> None:
        self.builder = TraceProtoBuilder()
        self.events: list[tuple[int, Callable[[TrackEvent], None]]] = []
        self._next_uuid = 0

    def track(self, name: str, parent: int | None = None, *, pid: int | None = None,
              counter_unit: int | None = None, unit_name: str = "") -> int:
        self._next_uuid += 1
        packet = self.builder.add_packet()
        packet.trusted_packet_sequence_id = SEQUENCE_ID
        descriptor = packet.track_descriptor
        descriptor.uuid = self._next_uuid
        if pid is not None:
            descriptor.process.pid, descriptor.process.process_name = pid, name
        else:
            descriptor.name = name
        if parent is not None:
            descriptor.parent_uuid = parent
        if counter_unit is not None:
            descriptor.counter.unit = counter_unit
            if unit_name:
                descriptor.counter.unit_name = unit_name
        return self._next_uuid

    def event(self, at: int, fill: Callable[[TrackEvent], None]) -> None:
        self.events.append((at, fill))

    def begin(self, track: int, name: str, at: int, annotations: dict | None = None,
              flow: int | None = None, terminating_flows: list[int] | None = None) -> None:
        def fill(event: TrackEvent) -> None:
            event.type, event.track_uuid, event.name = BEGIN, track, name
            for key, value in (annotations or {}).items():
                annotate(event, key, value)
            if flow is not None:
                event.flow_ids.append(flow)
            event.terminating_flow_ids.extend(terminating_flows or [])
        self.event(at, fill)

    def end(self, track: int, at: int) -> None:
        def fill(event: TrackEvent) -> None:
            event.type, event.track_uuid = END, track
        self.event(at, fill)

    def counter(self, track: int, at: int, value: float) -> None:
        def fill(event: TrackEvent) -> None:
            event.type, event.track_uuid, event.double_counter_value = COUNTER, track, value
        self.event(at, fill)

    def serialize(self) -> bytes:
        for at, fill in sorted(self.events, key=lambda e: e[0]):
            packet = self.builder.add_packet()
            packet.timestamp, packet.trusted_packet_sequence_id = at, SEQUENCE_ID
            fill(packet.track_event)
        return self.builder.serialize()


def annotate(event: TrackEvent, key: str, value) -> None:
    if value is None:
        return
    note = event.debug_annotations.add()
    note.name = key
    if isinstance(value, bool):
        note.bool_value = value
    elif isinstance(value, int):
        note.int_value = value
    elif isinstance(value, float):
        note.double_value = value
    else:
        note.string_value = str(value)


def session_trace(timeline: SessionTimeline, now: datetime) -> bytes:
    """The `.pftrace` bytes of `timeline`, built at `now` (the end of what has not finished)."""
    w = _Writer()
    session = w.track(f"session {timeline.session_id}", pid=SESSION_PID)
    lanes = {model_id: w.track(model_id, session) for model_id in timeline.runs + timeline.samplers}
    cycle_lane = w.track("trainer cycles", session) if timeline.cycles else None
    end_of = {r.request_id: max(ns(r.created_at), ns(r.finished_at or now)) for r in timeline.requests}

    flows: dict[datetime, list[int]] = {}
    for flow, r in enumerate(timeline.requests, start=1):
        track = w.track("requests", lanes[r.model_id])
        cycle = timeline.cycles.get(r.started_at) if r.started_at is not None else None
        start, end = ns(r.created_at), end_of[r.request_id]
        w.begin(track, f"{r.kind} #{r.seq_id}" if r.seq_id is not None else r.kind, start, _numbers(r, cycle))
        if r.kind == RequestKind.SAMPLE:  # the sampler batches continuously: no wait of its own is recorded
            w.begin(track, "sampling", start)
        elif r.started_at is None:
            w.begin(track, "queued", start)
        else:
            started = _started(r, end)
            w.begin(track, "queued", start)
            w.end(track, started)
            w.begin(track, "compute", started, flow=flow if cycle else None)
            if cycle:
                flows.setdefault(cycle.started_at, []).append(flow)
        w.end(track, end)  # the child's
        w.end(track, end)  # the request's

    own_in: dict[datetime, list[RequestSpan]] = {}
    for r in timeline.requests:
        if r.started_at in timeline.cycles:
            own_in.setdefault(r.started_at, []).append(r)
    for key, cycle in sorted(timeline.cycles.items()):
        own = own_in[key]
        start = ns(key)
        end = max(start, ns(cycle.finished_at) if cycle.finished_at else max(end_of[r.request_id] for r in own))
        track = w.track("trainer cycles", cycle_lane)
        w.begin(track, "cycle", start, {
            "requests": cycle.requests, "tokens": cycle.tokens, "tenants": cycle.tenants,
            "other_tenants": cycle.tenants - 1, "own_requests": len(own), "own_tokens": sum(r.num_tokens for r in own),
        }, terminating_flows=flows.get(key))
        w.end(track, end)

    _concurrency(w, session, timeline.requests, end_of)
    _throughput(w, session, timeline.requests, end_of)
    return w.serialize()


def _started(r: RequestSpan, end: int) -> int:
    """When `r` (started) began computing, within its span."""
    return min(max(ns(r.created_at), ns(r.started_at)), end)


def _numbers(r: RequestSpan, cycle: Cycle | None) -> dict:
    numbers = {"request_id": r.request_id, "model_id": r.model_id, "seq_id": r.seq_id, "state": r.state,
               "input_tokens": r.num_tokens, "error": r.error}
    if r.kind == RequestKind.SAMPLE:
        numbers["output_tokens"] = r.output_tokens
    if cycle is not None:
        numbers |= {"cycle_requests": cycle.requests, "cycle_tokens": cycle.tokens, "cycle_tenants": cycle.tenants}
    return numbers


def _concurrency(w: _Writer, session: int, requests: list[RequestSpan], end_of: dict[str, int]) -> None:
    """Requests waiting for the trainer, and requests computing (samples: sampling), over time."""
    steps: dict[str, list[tuple[int, int]]] = {"requests queued": [], "requests running": []}
    for r in requests:
        start, end = ns(r.created_at), end_of[r.request_id]
        running_from = start if r.kind == RequestKind.SAMPLE else _started(r, end) if r.started_at else end
        for name, since, until in (("requests queued", start, running_from), ("requests running", running_from, end)):
            if since < until:
                steps[name] += [(since, 1), (until, -1)]
    for name, changes in steps.items():
        track = w.track(name, session, counter_unit=CounterDescriptor.UNIT_COUNT)
        level, points = 0, {}
        for at, change in sorted(changes):
            level += change
            points[at] = level  # the level after every change at that instant
        shown = None
        for at, value in points.items():
            if value != shown:
                w.counter(track, at, value)
                shown = value


def _throughput(w: _Writer, session: int, requests: list[RequestSpan], end_of: dict[str, int]) -> None:
    """Tokens per second by when their requests finished, in bins of at least a second."""
    finished = [r for r in requests if r.finished_at is not None]
    if not finished:
        return
    first, last = ns(requests[0].created_at), max(end_of.values())
    width = max(10**9, math.ceil((last - first + 1) / THROUGHPUT_POINTS))
    bins = (last - first) // width + 1
    series = {"trained tokens/s": [0] * bins, "sampled tokens/s": [0] * bins}
    for r in finished:
        at = (ns(r.finished_at) - first) // width
        if r.kind == RequestKind.SAMPLE:
            series["sampled tokens/s"][at] += r.num_tokens + r.output_tokens
        elif r.kind in TRAINED_KINDS:
            series["trained tokens/s"][at] += r.num_tokens
    for name, tokens in series.items():
        if not any(tokens):
            continue
        track = w.track(name, session, counter_unit=CounterDescriptor.UNIT_UNSPECIFIED, unit_name="tokens/s")
        for i, count in enumerate(tokens):
            w.counter(track, first + i * width, count * 10**9 / width)
        w.counter(track, first + bins * width, 0.0)

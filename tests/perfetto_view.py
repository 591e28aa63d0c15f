"""A Perfetto trace read back with the `perfetto` package's own protobuf classes: its tracks, its slices
nested as their tracks hold them, and its counters' points, checking on the way what trace_processor
needs (descriptors before events, events in time order, every slice ended)."""

from __future__ import annotations

import urllib.request
from collections import defaultdict

from perfetto.protos.perfetto.trace.perfetto_trace_pb2 import Trace, TrackEvent


def read_trace(url: str) -> tuple[bytes, "TraceView"]:
    """The trace at `url` (bytes and view), fetched with no credential, as the SDK's CLI downloads it."""
    with urllib.request.urlopen(url, timeout=60) as response:
        raw = response.read()
    return raw, TraceView(Trace.FromString(raw))


class TraceView:
    """A trace's tracks, slices (nested by track) and counter points, as the trace holds them."""

    def __init__(self, trace: Trace) -> None:
        self.tracks, self.slices, self.counters = {}, [], defaultdict(list)
        open_slices: dict[int, list[dict]] = defaultdict(list)
        last = 0
        for packet in trace.packet:
            if packet.HasField("track_descriptor"):
                d = packet.track_descriptor
                self.tracks[d.uuid] = {"name": d.name or d.process.process_name, "parent": d.parent_uuid,
                                       "counter": d.HasField("counter")}
                continue
            event = packet.track_event
            assert packet.timestamp >= last, "events in time order"
            last = packet.timestamp
            assert event.track_uuid in self.tracks, "every event's track is described before it"
            if event.type == TrackEvent.TYPE_SLICE_BEGIN:
                stack = open_slices[event.track_uuid]
                entry = {"name": event.name, "track": event.track_uuid, "start": packet.timestamp,
                         "parent": stack[-1]["name"] if stack else None, "flows": list(event.flow_ids),
                         "ends_flows": list(event.terminating_flow_ids),
                         "args": {a.name: _value(a) for a in event.debug_annotations}}
                stack.append(entry)
                self.slices.append(entry)
            elif event.type == TrackEvent.TYPE_SLICE_END:
                open_slices[event.track_uuid].pop()["end"] = packet.timestamp
            elif event.type == TrackEvent.TYPE_COUNTER:
                name = self.tracks[event.track_uuid]["name"]
                self.counters[name].append((packet.timestamp, event.double_counter_value))
        assert not any(open_slices.values()), "every slice ends"

    def lane_of(self, entry: dict) -> str:
        """The name of the track above a request's own track: its run or sampler."""
        return self.tracks[self.tracks[entry["track"]]["parent"]]["name"]


def _value(annotation):
    for kind in ("int_value", "double_value", "bool_value", "string_value"):
        if annotation.HasField(kind):
            return getattr(annotation, kind)
    return None

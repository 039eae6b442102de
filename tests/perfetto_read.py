"""A reader of Perfetto protobuf traces for the tests, written from Perfetto's documentation ("Writing TrackEvent
protos synthetically") over Perfetto's own schema (the `perfetto` package's perfetto_trace_pb2): it replays the
packets the way the trace processor does and fails on what Perfetto would reject or show wrongly: an event on a
track never described, an interned id used before it was defined, an end without a begin, slices on one track
that do not nest, a flow that does not start once and end once. It yields the slices in the trace-event model
(pid, tid, name, cat, ts and dur in µs, args) so they can be compared with the JSON timeline."""

from __future__ import annotations

from collections import Counter
from typing import Any

from perfetto.protos.perfetto.trace import perfetto_trace_pb2 as pb


def _value(ann: Any) -> Any:
    field = ann.WhichOneof("value")
    return getattr(ann, field) if field else None


def read(data: bytes) -> tuple[list[dict[str, Any]], dict[int, dict[str, Any]], dict[str, Any], int]:
    """(slices and instants as trace events, track uuid -> descriptor summary, the "aiflame timeline" info args,
    the number of flows)."""
    trace = pb.Trace.FromString(data)
    interned: dict[str, dict[int, str]] = {"event_names": {}, "event_categories": {}, "debug_annotation_names": {}}
    tracks: dict[int, dict[str, Any]] = {}
    open_: dict[int, list[dict[str, Any]]] = {}
    out: list[dict[str, Any]] = []
    info: dict[str, Any] = {}
    flows_out: Counter[int] = Counter()
    flows_in: Counter[int] = Counter()
    cleared = False
    last_ts = 0
    for packet in trace.packet:
        assert packet.trusted_packet_sequence_id == 1
        if packet.sequence_flags & pb.TracePacket.SEQ_INCREMENTAL_STATE_CLEARED:
            cleared = True
        for table, names in interned.items():
            for entry in getattr(packet.interned_data, table):
                assert entry.iid not in names, f"{table} iid {entry.iid} defined twice"
                names[entry.iid] = entry.name
        if packet.HasField("track_descriptor"):
            d = packet.track_descriptor
            assert d.uuid not in tracks and (not d.parent_uuid or d.parent_uuid in tracks), d
            parent = tracks.get(d.parent_uuid, {})
            pid = d.process.pid if d.HasField("process") else d.thread.pid if d.HasField("thread") else \
                parent.get("pid", -1)
            tracks[d.uuid] = {"pid": pid, "tid": d.thread.tid if d.HasField("thread") else None,
                              "name": d.process.process_name or d.thread.thread_name or d.name,
                              "sort": d.process.legacy_sort_index, "parent": d.parent_uuid}
            continue
        if not packet.HasField("track_event"):
            continue
        assert cleared and packet.sequence_flags & pb.TracePacket.SEQ_NEEDS_INCREMENTAL_STATE
        assert packet.timestamp >= last_ts, "packets out of time order"
        last_ts = packet.timestamp
        ev = packet.track_event
        assert ev.track_uuid in tracks, f"event on undescribed track {ev.track_uuid}"
        stack = open_.setdefault(ev.track_uuid, [])
        flows_out.update(ev.flow_ids)
        flows_in.update(ev.terminating_flow_ids)
        if ev.type == pb.TrackEvent.TYPE_SLICE_END:
            assert stack, f"end without begin on track {ev.track_uuid} at {packet.timestamp}"
            s = stack.pop()
            s["dur"] = round((packet.timestamp - s["_ts"]) / 1000, 3)
            continue
        name = interned["event_names"][ev.name_iid]
        args = {interned["debug_annotation_names"][a.name_iid]: _value(a) for a in ev.debug_annotations}
        if name == "aiflame timeline":
            info = args
            continue
        track = tracks[ev.track_uuid]
        e: dict[str, Any] = {"ph": "X" if ev.type == pb.TrackEvent.TYPE_SLICE_BEGIN else "i", "pid": track["pid"],
                             "track": ev.track_uuid, "name": name, "ts": round(packet.timestamp / 1000, 3),
                             "cat": ",".join(interned["event_categories"][c] for c in ev.category_iids),
                             "args": args, "_ts": packet.timestamp}
        out.append(e)
        if ev.type == pb.TrackEvent.TYPE_SLICE_BEGIN:
            stack.append(e)
    assert all(not s for s in open_.values()), "slices left open at the end"
    assert set(flows_out) == set(flows_in) and all(flows_out[i] == 1 == flows_in[i] for i in flows_out), \
        (flows_out, flows_in)
    for e in out:
        del e["_ts"]
    return out, tracks, info, len(flows_out)

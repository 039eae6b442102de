"""Perfetto's own trace format (protobuf TrackEvent packets) for the timeline exporters/perfetto.py lays out.

The trace-event list (Chrome's JSON model) stays the one description of the timeline; this module encodes it as
the format Perfetto records natively: one track per process (rank), thread and overlap lane, slices as begin/end
packets, names, categories and argument names interned once per trace, flows as flow ids on the slices they join.
A long job's timeline is less than half its JSON and opens in ui.perfetto.dev without the JSON importer's limits.
The schema comes from the `perfetto` package (Perfetto's own generated protos): descriptors, interned data and the
once-per-track packets are its messages; the per-slice packets are written by hand from the schema's field numbers
and types (twice as fast), one `Trace.packet` field at a time.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable, Iterator
from typing import Any

from google.protobuf import descriptor
from perfetto.protos.perfetto.trace import perfetto_trace_pb2 as pb

SEQUENCE_ID = 1  # every packet comes from one writer sequence
_D = descriptor.FieldDescriptor
_WIRE = {_D.TYPE_DOUBLE: 1, _D.TYPE_FIXED64: 1, _D.TYPE_SFIXED64: 1, _D.TYPE_STRING: 2, _D.TYPE_BYTES: 2,
         _D.TYPE_MESSAGE: 2, _D.TYPE_FLOAT: 5, _D.TYPE_FIXED32: 5, _D.TYPE_SFIXED32: 5}


_BYTE = [bytes((i,)) for i in range(0x80)]


def _varint(n: int) -> bytes:
    if 0 <= n < 0x80:
        return _BYTE[n]
    n &= (1 << 64) - 1  # int64 below zero: ten bytes of two's complement
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


class _Field:
    """One field of Perfetto's schema, written by hand: its tag from the schema's number and type, a value as
    the type's wire format. (Hot packets are encoded here; the message classes took twice as long.)"""

    def __init__(self, message: Any, name: str) -> None:
        f = message.DESCRIPTOR.fields_by_name[name]
        self.wire = _WIRE.get(f.type, 0)
        self.tag = _varint(f.number << 3 | self.wire)
        self.double = f.type == _D.TYPE_DOUBLE

    def __call__(self, value: int | float | bytes) -> bytes:
        if self.wire == 2:
            assert isinstance(value, bytes)
            return self.tag + _varint(len(value)) + value
        if self.wire == 1:
            return self.tag + struct.pack("<d" if self.double else "<Q", value)
        assert self.wire == 0 and isinstance(value, int)
        return self.tag + _varint(value)


_TRACE_PACKET = _Field(pb.Trace, "packet")
_P_TS, _P_SEQ, _P_FLAGS, _P_EVENT, _P_INTERNED, _P_TRACK = (
    _Field(pb.TracePacket, n) for n in ("timestamp", "trusted_packet_sequence_id", "sequence_flags", "track_event",
                                         "interned_data", "track_descriptor"))
_E_TYPE, _E_TRACK, _E_NAME, _E_CAT, _E_ANN, _E_FLOW, _E_END_FLOW = (
    _Field(pb.TrackEvent, n) for n in ("type", "track_uuid", "name_iid", "category_iids", "debug_annotations",
                                        "flow_ids", "terminating_flow_ids"))
_A_NAME, _A_BOOL, _A_INT, _A_DOUBLE, _A_STRING = (
    _Field(pb.DebugAnnotation, n) for n in ("name_iid", "bool_value", "int_value", "double_value", "string_value"))
_BEGIN, _END, _INSTANT = pb.TrackEvent.TYPE_SLICE_BEGIN, pb.TrackEvent.TYPE_SLICE_END, pb.TrackEvent.TYPE_INSTANT
_EVENT_HEAD = _P_SEQ(SEQUENCE_ID) + _P_FLAGS(pb.TracePacket.SEQ_NEEDS_INCREMENTAL_STATE)


class _Interned:
    """Names, categories and argument names by interning id; new ones ride on the next packet that uses them."""

    def __init__(self) -> None:
        self.ids: dict[tuple[str, str], int] = {}
        self.pending: list[tuple[str, int, str]] = []

    def iid(self, table: str, text: str) -> int:
        key = (table, text)
        found = self.ids.get(key)
        if found is None:
            found = self.ids[key] = len(self.ids) + 1
            self.pending.append((table, found, text))
        return found

    def take(self) -> bytes:
        """The interned_data field defining what was interned since the last call (empty bytes if nothing)."""
        if not self.pending:
            return b""
        data = pb.InternedData()
        for table, iid, text in self.pending:
            entry = getattr(data, table).add()
            entry.iid = iid
            entry.name = text
        self.pending.clear()
        return _P_INTERNED(data.SerializeToString())


def _ns(us: float) -> int:
    return round(us * 1000)


class _Annotations:
    """Debug annotations (the slice's arguments), each encoded once per distinct name and value."""

    def __init__(self, interned: _Interned) -> None:
        self.interned = interned
        self.cache: dict[tuple[str, type, object], bytes] = {}

    def __call__(self, args: dict[str, Any]) -> bytes:
        out = []
        for key, value in args.items():
            k = (key, type(value), value if isinstance(value, (int, str)) else None)
            found = self.cache.get(k) if k[2] is not None else None
            if found is None:
                name = _A_NAME(self.interned.iid("debug_annotation_names", key))
                if isinstance(value, bool):
                    body = name + _A_BOOL(int(value))
                elif isinstance(value, int) and -(1 << 63) <= value < (1 << 63):
                    body = name + _A_INT(value)
                elif isinstance(value, float):
                    body = name + _A_DOUBLE(value)
                else:
                    text = value if isinstance(value, str) else json.dumps(value, default=str)
                    body = name + _A_STRING(text.encode())
                found = _E_ANN(body)
                if k[2] is not None and len(self.cache) < 100_000:
                    self.cache[k] = found
            out.append(found)
        return b"".join(out)


class _Tracks:
    """Track descriptors from the trace-event metadata: a process track per pid; under it a thread track per real
    thread and a named track for the NPU compute row and each overlap lane (their tids are synthetic)."""

    def __init__(self, events: list[dict[str, Any]], synthetic_tid: int) -> None:
        self.synthetic_tid = synthetic_tid
        self.process_name: dict[int, str] = {}
        self.process_rank: dict[int, int] = {}
        self.thread_name: dict[tuple[int, int], str] = {}
        self.thread_rank: dict[tuple[int, int], int] = {}
        self.uuids: dict[tuple[int, int], int] = {}
        for e in events:
            if e["ph"] != "M":
                continue
            name, args, pid = e["name"], e.get("args", {}), e["pid"]
            if name == "process_name":
                self.process_name[pid] = str(args.get("name", ""))
            elif name == "process_sort_index":
                self.process_rank[pid] = int(args.get("sort_index", 0))
            elif name == "thread_name":
                self.thread_name[(pid, e["tid"])] = str(args.get("name", ""))
            elif name == "thread_sort_index":
                self.thread_rank[(pid, e["tid"])] = int(args.get("sort_index", 0))

    def uuid(self, pid: int, tid: int = -1) -> int:
        """A track's uuid; -1 for the process's own track."""
        key = (pid, tid)
        found = self.uuids.get(key)
        if found is None:
            found = self.uuids[key] = len(self.uuids) + 1
        return found

    def descriptors(self, used: Iterable[tuple[int, int]]) -> Iterator[Any]:
        threads = sorted(set(used))
        for pid in sorted({p for p, _ in threads} | set(self.process_name)):
            d = pb.TrackDescriptor(uuid=self.uuid(pid), child_ordering=pb.TrackDescriptor.EXPLICIT)
            d.process.pid = pid
            d.process.process_name = self.process_name.get(pid, f"process {pid}")
            d.process.legacy_sort_index = self.process_rank.get(pid, 0)
            yield d
        for order, (pid, tid) in enumerate(sorted(threads, key=lambda k: (k[0], self.thread_rank.get(k, 0), k[1]))):
            d = pb.TrackDescriptor(uuid=self.uuid(pid, tid), parent_uuid=self.uuid(pid), sibling_order_rank=order)
            name = self.thread_name.get((pid, tid), "thread")
            if tid >= self.synthetic_tid:
                d.name = name
            else:
                d.thread.pid, d.thread.tid, d.thread.thread_name = pid, tid, name
            yield d


def _flow_targets(events: list[dict[str, Any]]) -> tuple[dict[tuple[int, int, int, str], list[int]],
                                                          dict[tuple[int, int, int, str], list[int]]]:
    """Flow ids keyed by the slice they bind to: (pid, tid, start ns, cat) for a flow's start, (pid, tid, end ns,
    cat) for its end (the trace-event model binds "s" to the slice open at its ts and "f" with bp=e to the one that
    ends there)."""
    out: dict[tuple[int, int, int, str], list[int]] = {}
    into: dict[tuple[int, int, int, str], list[int]] = {}
    for e in events:
        if e["ph"] in ("s", "f"):
            key = (e["pid"], e["tid"], _ns(e["ts"]), e.get("cat", ""))
            (out if e["ph"] == "s" else into).setdefault(key, []).append(int(e["id"]))
    return out, into


_TS_TAG, _EVENT_TAG, _PACKET_TAG = _P_TS.tag, _P_EVENT.tag, _TRACE_PACKET.tag


def _packet(ts: int, event: bytes, interned: bytes = b"") -> bytes:
    body = b"".join((_TS_TAG, _varint(ts), _EVENT_HEAD, _EVENT_TAG, _varint(len(event)), event, interned))
    return _PACKET_TAG + _varint(len(body)) + body


def encode(events: list[dict[str, Any]], other: dict[str, Any], synthetic_tid: int) -> bytes:
    """The trace-event list (and the JSON's `otherData`) as a Perfetto protobuf trace; `synthetic_tid`: tids at or
    above it are not threads (the NPU row, overlap lanes) and get named tracks."""
    interned = _Interned()
    annotate = _Annotations(interned)
    tracks = _Tracks(events, synthetic_tid)
    flows_out, flows_in = _flow_targets(events)
    # (time, order, tie, index, event): at one instant ends come first, inner ones before outer ones, then
    # begins, outer ones first; a slice without duration opens and closes at once
    timed: list[tuple[int, int, int, int, dict[str, Any]]] = []
    used: set[tuple[int, int]] = set()
    for i, e in enumerate(events):
        if e["ph"] == "X":
            start, dur = _ns(e["ts"]), _ns(e["dur"])
            used.add((e["pid"], e["tid"]))
            timed.append((start, 1, -dur, i, e))
            if dur:
                timed.append((start + dur, 0, -start, -i, e))
        elif e["ph"] == "i":
            used.add((e["pid"], e["tid"]))
            timed.append((_ns(e["ts"]), 1, 0, i, e))
    timed.sort(key=lambda t: t[:4])

    chunks = [_TRACE_PACKET(_P_SEQ(SEQUENCE_ID) + _P_FLAGS(pb.TracePacket.SEQ_INCREMENTAL_STATE_CLEARED))]
    chunks += [_TRACE_PACKET(_P_SEQ(SEQUENCE_ID) + _P_TRACK(d.SerializeToString()))
               for d in tracks.descriptors(used)]
    if other:
        chunks.append(_TRACE_PACKET(_P_SEQ(SEQUENCE_ID) + _P_TRACK(
            pb.TrackDescriptor(uuid=tracks.uuid(-1), name="aiflame").SerializeToString())))
        event = _E_TYPE(_INSTANT) + _E_TRACK(tracks.uuid(-1)) + \
            _E_NAME(interned.iid("event_names", "aiflame timeline")) + annotate(other)
        chunks.append(_packet(0, event, interned.take()))
    ends: dict[int, bytes] = {}  # track uuid -> its end event
    heads: dict[tuple[int, str, str, str], bytes] = {}  # (track, phase, name, category) -> a begin's first fields
    for ts, order, _, _, e in timed:
        pid, tid, ph = e["pid"], e["tid"], e["ph"]
        cat = e.get("cat", "")
        key = (pid, tid, ts, cat)
        if order == 0:  # a slice's end
            track = tracks.uuid(pid, tid)
            end = ends.get(track) or ends.setdefault(track, _E_TYPE(_END) + _E_TRACK(track))
            flows = flows_in.pop(key, None)
            chunks.append(_packet(ts, end + b"".join(_E_END_FLOW(f) for f in flows) if flows else end))
            continue
        head_key = (tracks.uuid(pid, tid), ph, str(e["name"]), cat)
        cached = heads.get(head_key)
        if cached is None:
            cached = _E_TYPE(_INSTANT if ph == "i" else _BEGIN) + _E_TRACK(head_key[0]) + \
                _E_NAME(interned.iid("event_names", head_key[2]))
            if cat:
                cached += _E_CAT(interned.iid("event_categories", cat))
            heads[head_key] = cached
        event = cached
        args = e.get("args")
        if args:
            event += annotate(args)
        if ph == "X" and key in flows_out:
            event += b"".join(_E_FLOW(f) for f in flows_out.pop(key))
        chunks.append(_packet(ts, event, interned.take()))
        if ph == "X" and not _ns(e["dur"]):
            track = head_key[0]
            end = ends.get(track) or ends.setdefault(track, _E_TYPE(_END) + _E_TRACK(track))
            chunks.append(_packet(ts, end + b"".join(_E_END_FLOW(f) for f in flows_in.pop(key, ()))))
    return b"".join(chunks)

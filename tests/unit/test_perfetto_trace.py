"""The Perfetto protobuf encoding of a trace-event timeline (exporters/perfetto_trace.py), property-tested: random
nested slices on several tracks, sharing starts and ends with their parents and neighbours, some without duration,
with instants, arguments of every type and flows, must read back (tests/perfetto_read.py, Perfetto's TrackEvent
rules) as exactly the slices that were encoded."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from aiflame.exporters.perfetto import LANE_TID
from aiflame.exporters.perfetto_trace import encode
from tests import perfetto_read

ARGS = st.dictionaries(st.sampled_from(["bytes", "peer", "name", "ok", "ratio", "list"]),
                       st.one_of(st.integers(-(1 << 62), 1 << 62), st.booleans(), st.text(max_size=8),
                                 st.floats(allow_nan=False, allow_infinity=False)), max_size=3)


@st.composite
def nested(draw: st.DrawFn, lo: int, hi: int, depth: int) -> list[tuple[int, int, int]]:
    """(start, end, depth) of slices that nest inside [lo, hi]: sorted cut points, so neighbours and parents may
    share an edge and a slice may be empty."""
    if depth > 3 or hi < lo:
        return []
    cuts = sorted(draw(st.lists(st.integers(lo, hi), max_size=6)))
    out = []
    for a, b in zip(cuts[::2], cuts[1::2], strict=False):
        out.append((a, b, depth))
        out += draw(nested(a, b, depth + 1))
    return out


@st.composite
def timelines(draw: st.DrawFn) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = []
    for pid in draw(st.lists(st.integers(1, 5), min_size=1, max_size=2, unique=True)):
        events.append({"ph": "M", "pid": pid, "name": "process_name", "args": {"name": f"rank {pid}"}})
        events.append({"ph": "M", "pid": pid, "name": "process_sort_index", "args": {"sort_index": pid}})
        for tid in draw(st.lists(st.sampled_from([pid * 10, pid * 10 + 1, LANE_TID + pid]), min_size=1,
                                 max_size=3, unique=True)):
            events.append({"ph": "M", "pid": pid, "tid": tid, "name": "thread_name", "args": {"name": f"t{tid}"}})
            for a, b, d in draw(nested(0, 2000, 0)):
                events.append({"ph": "X", "pid": pid, "tid": tid, "name": f"s{d}", "cat": draw(st.sampled_from(
                    ["compute", "wait", "p2p"])), "ts": a / 1000, "dur": (b - a) / 1000, "args": draw(ARGS)})
            if draw(st.booleans()):
                events.append({"ph": "i", "s": "p", "pid": pid, "tid": tid, "name": "mark",
                               "ts": draw(st.integers(0, 2000)) / 1000, "args": {}})
    slices = [e for e in events if e["ph"] == "X"]
    if len(slices) >= 2:  # one flow from a slice's start to another's end, as a send and its receive
        src, dst = draw(st.permutations(slices))[:2]
        events.append({"ph": "s", "id": 1, "pid": src["pid"], "tid": src["tid"], "ts": src["ts"],
                       "cat": src["cat"]})
        events.append({"ph": "f", "bp": "e", "id": 1, "pid": dst["pid"], "tid": dst["tid"],
                       "ts": round(dst["ts"] + dst["dur"], 3), "cat": dst["cat"]})
    return events


def _norm(e: dict[str, Any]) -> tuple[Any, ...]:
    args = tuple(sorted((k, v if not isinstance(v, float) else round(v, 6)) for k, v in e.get("args", {}).items()))
    return (e["ph"], e["pid"], e["name"], e["ts"], e.get("dur", -1.0), e.get("cat", ""), repr(args))


@settings(max_examples=300, deadline=None)
@given(timelines())
def test_slices_read_back_exactly(events: list[dict[str, Any]]) -> None:
    # Oracle: Perfetto's own schema and TrackEvent rules (tests/perfetto_read.py), on random timelines
    slices, tracks, info, flows = perfetto_read.read(encode(events, {"producer": "test"}, LANE_TID))
    assert info == {"producer": "test"}
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    got = sorted(_norm(e) + (tracks[e["track"]]["name"],) for e in slices)
    want = sorted(_norm(e) + (names[(e["pid"], e["tid"])],) for e in events if e["ph"] in ("X", "i"))
    assert got == want
    assert flows == sum(1 for e in events if e["ph"] == "s")
    # real threads are thread tracks of their process; the synthetic tids (lanes, the NPU row) are named tracks
    for t in tracks.values():
        if t["parent"]:
            tid = int(t["name"][1:])
            assert t["tid"] == (None if tid >= LANE_TID else tid)

"""What goes with the Chakra traces to the simulator and back: the network fitted to a capture, the comparison of
ASTRA-sim's output with the capture (`aiflame report sim`), and the Perfetto timeline made of the same intervals,
checked against the trace-event format (Chrome's Trace Event Format document: the JSON object form, complete
"X" events with ts/dur in microseconds, "M" metadata, "i" instants, "s"/"f" flows, and slices on one thread that
nest)."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from aiflame.cli.commands.report import report_sim
from aiflame.core.errors import Unreadable
from aiflame.core.model import Profile
from aiflame.exporters import REGISTRY, get_exporter
from aiflame.exporters.chakra import write_traces
from aiflame.exporters.chakra_network import fit_network, network_yaml
from aiflame.exporters.chakra_nodes import COMP, build_traces
from aiflame.exporters.perfetto import NPU_TID
from aiflame.exporters.rank_timeline import build_timeline
from aiflame.exporters.sim_report import compare, idle_notes, parse_sim_log, problems
from tests import perfetto_read
from tests.unit.test_chakra import MS, ev, gloo_job, replayed_finish, samples, timed_job

LOG = "".join(f"[2026-11-25 15:27:16.872] [workload] [info] sys[{r}] finished, {t} cycles, exposed communication "
              f"{e} cycles.\n[2026-11-25 15:27:16.872] [statistics] [info] sys[{r}], Wall time: {t}\n"
              for r, t, e in ((0, 50_000_000, 13_000_000), (1, 49_000_000, 12_000_000)))


def test_network_fit_recovers_latency_and_bandwidth() -> None:
    """All-reduces that took 16 x 1 µs latency plus 1 ns per byte (2 ranks, 4 splits in the model)."""
    # Oracle: by construction — all-reduces that took 16 x 1 µs plus 1 ns per byte
    prof = Profile()
    t = 0
    for size in (64, 64, 1 << 20, 4096):
        for r in (0, 1):
            prof.events.append(ev(r, "allreduce", t + 1000 * r, 16_000 + size + 1000 * (1 - r), tid=7, bytes=size))
        t += 10 * MS
    fit = fit_network(build_traces(prof))
    assert fit is not None and fit.calls == 4
    assert fit.latency_ns == pytest.approx(1000, rel=0.1)
    assert fit.bandwidth_gibps == pytest.approx(1e9 / (1 << 30), rel=0.01)  # 1 byte per ns
    text = network_yaml(fit, 2)
    assert "topology: [ Switch ]" in text and "npus_count: [ 2 ]" in text and "bandwidth: [ 0.93" in text


def test_export_writes_the_network_and_checks(tmp_path: Path) -> None:
    files, traces = write_traces(timed_job(), tmp_path / "job")
    assert [p.name for p in traces.extra_files] == ["job.network.yml"] and traces.problems == []
    assert "latency:" in (tmp_path / "job.network.yml").read_text()


def test_sim_log_compared_with_the_capture() -> None:
    # Oracle: by construction — an ASTRA-sim log written here in its format, and timed_job's window
    tl = build_timeline(timed_job())
    rows = compare(tl, parse_sim_log(LOG))
    assert [(r.rank, r.measured_ns, r.simulated_ns, r.measured_exposed_ns) for r in rows] == \
        [(0, 49 * MS, 50 * MS, 12 * MS), (1, 49 * MS, 49 * MS, 12 * MS)]
    assert rows[0].step_error == pytest.approx(1 / 49) and rows[0].exposed_error == pytest.approx(1 / 12)
    assert problems(tl, parse_sim_log(LOG)) == []
    half = parse_sim_log(LOG.splitlines()[0] + "\n[x] [HardwareResource] [critical] GPU comm node id: 56\n")
    assert [p.split(" ")[0] for p in problems(tl, half)] == ["rank(s)", "the"]
    with pytest.raises(Unreadable, match="no 'sys"):
        parse_sim_log("hello\n")


def test_simulated_and_measured_exposed_are_the_same_quantity() -> None:
    """A replay that takes the captured durations (what a perfectly fitted simulator does) finishes at the window
    less the idle time, and its exposed communication (finish - the COMP nodes) is the measured one: compute
    overlapping an all-reduce, an all-reduce the rank waited for, 200 ms blocked outside communication."""
    # Oracle: replayed_finish (a replay written for the tests); the blocked 200 ms by construction
    prof = Profile(meta={"frequency_hz": "1000"})
    for r in (0, 1):
        prof.events += [ev(r, "allreduce", 0, MS, tid=7, bytes=64),
                        ev(r, "allreduce", 50 * MS, 10 * MS, tid=7, bytes=1 << 20),  # backward goes on computing
                        ev(r, "allreduce", 320 * MS, 10 * MS, tid=7, bytes=1 << 20),  # the rank waits for it
                        ev(r, "allreduce", 400 * MS, MS, tid=7, bytes=64)]
        busy = [*range(1, 100), *range(300, 320), *range(330, 400)]  # 100-300 ms: blocked (a sleep, I/O)
        prof.samples += samples(r, [int((t + 0.5) * MS) for t in busy])
    traces = build_traces(prof)
    log = ""
    for r, t in traces.ranks.items():
        finish = replayed_finish(t.nodes) - t.nodes[0].start_ns
        compute = sum(n.duration_ns for n in t.nodes if n.type == COMP)
        log += f"sys[{r}] finished, {finish} cycles, exposed communication {finish - compute} cycles.\n"
    rows = compare(traces.timeline, parse_sim_log(log))
    for row in rows:
        assert row.idle_ns == pytest.approx(200 * MS, rel=0.02)
        assert row.measured_exposed_ns == pytest.approx(11 * MS, abs=MS)  # 1 + 10 + what the samples left at 50-60
        assert row.simulated_exposed_ns == row.measured_exposed_ns and row.simulated_ns == row.traced_ns
        assert row.traced_error == 0 and row.step_error == pytest.approx(-row.idle_ns / row.measured_ns)
    notes = idle_notes(rows)
    assert len(notes) == 2 and "not in the trace" in notes[0] and notes[0].endswith("+0.0%")


def test_report_sim_prints_a_table(tmp_path: Path) -> None:
    # Oracle: by construction — the log's 50 and 49 ms against timed_job's 49 ms window
    log = tmp_path / "log"
    log.mkdir()
    (log / "log.log").write_text(LOG)
    console = Console(record=True, width=120)
    rows = report_sim(timed_job(), log, console)
    text = console.export_text()
    assert len(rows) == 2 and "+2.0%" in text and "+8.3%" in text


# --- Perfetto ----------------------------------------------------------------------------------------------------

PHASES = {"X", "M", "i", "s", "f"}


def check_trace_events(doc: dict[str, Any]) -> dict[tuple[int, int], list[dict[str, Any]]]:
    """The trace-event format's rules our writer uses; returns the complete events per (pid, tid)."""
    assert isinstance(doc["traceEvents"], list) and doc.get("displayTimeUnit") in ("ms", "ns")
    tracks: dict[tuple[int, int], list[dict[str, Any]]] = defaultdict(list)
    flows: dict[int, list[str]] = defaultdict(list)
    for e in doc["traceEvents"]:
        assert e["ph"] in PHASES and isinstance(e["pid"], int) and isinstance(e["name"], str)
        if e["ph"] == "M":
            assert e["name"] in ("process_name", "process_sort_index", "thread_name", "thread_sort_index")
            assert isinstance(e["args"], dict)
            continue
        assert isinstance(e["tid"], int) and isinstance(e["ts"], int | float) and e["ts"] >= 0
        if e["ph"] == "X":
            assert isinstance(e["dur"], int | float) and e["dur"] >= 0 and isinstance(e.get("args", {}), dict)
            tracks[(e["pid"], e["tid"])].append(e)
        elif e["ph"] in "sf":
            flows[e["id"]].append(e["ph"])
            # Perfetto and chrome://tracing bind a flow event to the slice open on its own track at its ts: the
            # send it starts at, the receive it ends in ("bp": "e").
            name = "send" if e["ph"] == "s" else "recv"
            bound = [x for x in doc["traceEvents"] if x["ph"] == "X" and x["pid"] == e["pid"]
                     and x["tid"] == e["tid"] and x["name"] == name and x["cat"] == e["cat"]
                     and x["ts"] <= e["ts"] <= round(x["ts"] + x["dur"], 3)]
            assert len(bound) == 1 and (e["ph"] == "f") == (e.get("bp") == "e"), (e, bound)
        else:
            assert e["s"] in "gpt"
    assert all(sorted(f) == ["f", "s"] for f in flows.values()), flows
    for evs in tracks.values():  # slices on one track nest: each ends before its parent does
        stack: list[float] = []
        for e in sorted(evs, key=lambda x: (x["ts"], -x["dur"])):
            while stack and stack[-1] <= e["ts"] + 1e-9:
                stack.pop()
            end = e["ts"] + e["dur"]
            assert not stack or end <= stack[-1] + 1e-6, (e, stack)
            stack.append(end)
    return tracks


@pytest.mark.parametrize("make", [timed_job, gloo_job])
def test_perfetto_timeline_follows_the_format_and_the_chakra_nodes(make: Any) -> None:
    # Oracle: Chrome's Trace Event Format (check_trace_events, written from the document); COMP nodes
    assert REGISTRY["perfetto-json"].extension == ".perfetto.json"
    prof = make()
    doc = json.loads(get_exporter("perfetto-json").render(prof))
    tracks = check_trace_events(doc)
    traces = build_traces(prof)
    base = prof.start_ns or traces.timeline.start_ns
    for r, t in traces.ranks.items():
        pid = t.pids[0]
        npu = [e for e in tracks[(pid, NPU_TID)] if e["cat"] == "compute"]
        comp = [n for n in t.nodes if n.type == COMP]
        # the compute slices are the COMP nodes: same starts and durations (µs)
        assert [(round(e["ts"], 3), round(e["dur"], 3)) for e in npu if e["dur"] >= 1] == \
            [(round((n.start_ns - base) / 1000, 3), round(n.duration_ns / 1000, 3)) for n in comp]
        colls = [e for evs in tracks.values() for e in evs if e["pid"] == pid and e["cat"] == "collective"]
        assert len(colls) == sum(1 for op in traces.timeline.ranks[r].ops if op.kind == "collective")
        assert all("simulated_as" in e["args"] and "bytes" in e["args"] for e in colls)
    p2p = [e for evs in tracks.values() for e in evs if e["cat"] == "p2p"]
    assert p2p and all("peer" in e["args"] and "bytes" in e["args"] for e in p2p)
    names = [e["args"]["name"] for e in doc["traceEvents"] if e["ph"] == "M" and e["name"] == "process_name"]
    assert names == ["rank 0", "rank 1"]  # viewers add "(pid 100)" themselves


def test_perfetto_flows_follow_a_send_and_receive_moved_to_an_overlap_lane() -> None:
    """A send or receive that crosses another slice on its thread goes to an extra lane; its flow end goes with it
    (left on the thread, it bound to whatever was open there: chrome://tracing drew the all-gather sending to the
    recv's wait)."""
    # Oracle: Chrome's Trace Event Format: a flow binds to the slice open on its track
    prof = gloo_job()
    for r in (0, 1):  # an all-gather on the point-to-point thread that ends inside the send/recv (from 200 µs)
        prof.events.append(ev(r, "allgather", 199_000, 2000, tid=100 + r, bytes=64))
    doc = json.loads(get_exporter("perfetto-json").render(prof))
    tracks = check_trace_events(doc)  # each flow event on its slice's track
    p2p = {e["name"]: e["tid"] for evs in tracks.values() for e in evs if e["cat"] == "p2p"}
    assert p2p["send"] not in (100, 101) and p2p["recv"] not in (100, 101)  # moved off the ranks' threads
    assert sorted((e["ph"], e["tid"]) for e in doc["traceEvents"] if e["ph"] in "sf") == \
        [("f", p2p["recv"]), ("s", p2p["send"])]


def test_perfetto_without_events_is_an_empty_timeline() -> None:
    # Oracle: Perfetto's own schema (the perfetto package), read by tests/perfetto_read.py
    doc = json.loads(get_exporter("perfetto-json").render(Profile()))
    assert doc["traceEvents"] == []
    slices, _, info, _ = perfetto_read.read(get_exporter("perfetto").render(Profile()))
    assert slices == [] and info["producer"] == "aiflame"


def same_timeline(doc: dict[str, Any], data: bytes) -> None:
    """The protobuf trace holds the JSON timeline's slices and instants (same pid, track name, name, category,
    start, duration and arguments), its processes in rank order, and one flow per message."""
    slices, tracks, info, flows = perfetto_read.read(data)
    assert info["world_size"] == doc["otherData"]["world_size"]
    meta = [e for e in doc["traceEvents"] if e["ph"] == "M"]
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in meta if e["name"] == "thread_name"}
    procs = {e["pid"]: e["args"]["name"] for e in meta if e["name"] == "process_name"}
    order = {e["pid"]: e["args"]["sort_index"] for e in meta if e["name"] == "process_sort_index"}
    got_procs = {t["pid"]: (t["name"], t["sort"]) for t in tracks.values() if not t["parent"] and t["pid"] >= 0}
    assert got_procs == {pid: (name, order[pid]) for pid, name in procs.items()}
    for e in slices:
        e["thread"] = tracks[e.pop("track")]["name"]
    want = [{"ph": e["ph"], "pid": e["pid"], "name": e["name"], "ts": e["ts"], "cat": e.get("cat", ""),
             "args": e.get("args", {}), "thread": threads.get((e["pid"], e["tid"]), "thread"),
             **({"dur": e["dur"]} if e["ph"] == "X" else {})}
            for e in doc["traceEvents"] if e["ph"] in ("X", "i")]

    def key(e: dict[str, Any]) -> tuple[Any, ...]:
        return (e["pid"], e["thread"], e["ts"], -e.get("dur", 0), e["name"])

    assert sorted(slices, key=key) == sorted(want, key=key)
    assert flows == sum(1 for e in doc["traceEvents"] if e["ph"] == "s")


@pytest.mark.parametrize("make", [timed_job, gloo_job])
def test_perfetto_protobuf_is_the_json_timeline(make: Any) -> None:
    """`perfetto` (Perfetto's protobuf) and `perfetto-json` are one timeline: read back by a reader that applies
    Perfetto's TrackEvent rules (tests/perfetto_read.py), every slice, instant, name and argument is there."""
    # Oracle: Perfetto's own schema and TrackEvent rules (tests/perfetto_read.py), against the JSON timeline
    assert REGISTRY["perfetto"].extension == ".pftrace" and not REGISTRY["perfetto"].text
    prof = make()
    doc = json.loads(get_exporter("perfetto-json").render(prof))
    data = get_exporter("perfetto").render(prof)
    same_timeline(doc, data)
    assert len(data) < len(json.dumps(doc)) / 2

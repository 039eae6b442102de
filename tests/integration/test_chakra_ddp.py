"""Chakra traces, the Perfetto timeline, the balance report and obfuscation from a real 2-rank gloo DDP job
(examples/ddp_gloo.py, CPU PyTorch: all-reduce, all-gather, broadcast, uneven all-to-all, send/recv, reduce,
gather, scatter, barrier) captured under `aiflame profile` as root. Every `.et` passes our validator of
ASTRA-sim's input rules (the simulator itself is not needed), holds exactly the communication the program says it
made, as the collectives the simulator runs with one size on every rank, and compute nodes that hold compute
only; the report flags the deliberately uneven ranks."""

from __future__ import annotations

import json
import math
import re
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from aiflame.exporters.chakra_check import check
from tests.conftest import REPO
from tests.integration.conftest import aiflame
from tests.unit.test_chakra_replay import attrs, load, pb, replay
from tests.unit.test_chakra_sim import check_trace_events, same_timeline

STEPS = 3
Job = tuple[Path, dict[int, dict[str, Any]]]  # output directory, the program's account by rank



def _same(b: int) -> int:
    return b


def _all_gather(b: int) -> int:
    return max(b, 64)


def _broadcast(b: int) -> int:  # buffer / (N - 1), N = 2
    return max(math.ceil(b / 1), 64)


# the program's collective -> (the simulated type, its size from the program's bytes); docs/chakra.md
MAPPED: dict[str, tuple[int, Callable[[int], int]]] = {
    "allreduce": (pb.ALL_REDUCE, _same), "reduce": (pb.ALL_REDUCE, _same), "barrier": (pb.ALL_REDUCE, lambda b: 1),
    "allgather": (pb.ALL_GATHER, _all_gather), "gather": (pb.ALL_GATHER, _all_gather),
    "scatter": (pb.ALL_GATHER, _all_gather), "broadcast": (pb.ALL_GATHER, _broadcast)}


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> Job:
    tmp = tmp_path_factory.mktemp("chakra")
    expect = tmp / "expect.jsonl"
    aiflame("profile", "-o", str(tmp / "out"), "-q", "-F", "499", "--formats", "folded,chakra,perfetto,perfetto-json",
            "--",
            sys.executable, str(REPO / "examples" / "ddp_gloo.py"), "--steps", str(STEPS), "--expect", str(expect),
            timeout=150)
    ranks = {}
    for line in expect.read_text().splitlines():
        rec = json.loads(line)
        ranks[rec["rank"]] = rec
    assert sorted(ranks) == [0, 1]
    return tmp / "out", ranks


def comm(nodes: list[Any]) -> list[Any]:
    return [n for n in nodes if n.type != pb.COMP_NODE]


def test_traces_pass_the_validator_and_hold_the_programs_communication(job: Job) -> None:
    # Oracle: the program's own record of its collectives (ddp_gloo.py); mlc-chakra's decoder
    out, ranks = job
    files = sorted(out.glob("profile.*.et"))
    assert [f.name for f in files] == ["profile.0.et", "profile.1.et"]
    assert check(files) == []
    traces = load(files)
    replay(traces)
    seqs = {}
    for r, rec in ranks.items():
        other = ranks[1 - r]
        want: Counter[tuple[Any, ...]] = Counter()
        for c in rec["collectives"]:
            kind, size = c["type"], c["bytes"]
            if kind in MAPPED:
                ctype, rule = MAPPED[kind]
                want[(kind, pb.COMM_COLL_NODE, ctype, rule(size), size)] += 1
            elif kind == "send":
                want[(kind, pb.COMM_SEND_NODE, None, size, size)] += 1
            elif kind == "recv":  # the size the sender sent
                sent = next(x["bytes"] for x in other["collectives"] if x["type"] == "send")
                want[(kind, pb.COMM_RECV_NODE, None, sent, size)] += 1
        got = Counter((n.name, n.type, attrs(n).get("comm_type"), attrs(n)["comm_size"], attrs(n)["aiflame_bytes"])
                      for n in comm(traces[r]) if n.name != "alltoallv")
        assert got == want, f"rank {r}: missing {want - got}, extra {got - want}"
        a2a = [attrs(n) for n in traces[r] if n.name == "alltoallv"]
        assert len(a2a) == 1 and a2a[0]["comm_type"] == pb.ALL_TO_ALL
        assert a2a[0]["aiflame_bytes"] == next(c["bytes"] for c in rec["collectives"] if c["type"] == "alltoallv")
        seqs[r] = [(n.name, attrs(n)["comm_type"], attrs(n)["comm_size"]) for n in traces[r]
                   if n.type == pb.COMM_COLL_NODE]
    assert seqs[0] == seqs[1]  # the same collectives, sizes and order on both ranks (uneven all-to-all included)
    a2a_size = next(s for name, _, s in seqs[0] if name == "alltoallv")
    sent = [attrs(n)["aiflame_wire_sent"] for nodes in traces.values() for n in nodes if n.name == "alltoallv"]
    assert a2a_size == 2 * max(sent)


def test_nodes_hold_compute_only_and_point_back(job: Job) -> None:
    # Oracle: mlc-chakra's decoder; the program's structure (forward and backward between collectives)
    out, _ = job
    traces = load(sorted(out.glob("profile.*.et")))
    for nodes in traces.values():
        ids = {n.id for n in nodes}
        for n in nodes:
            assert all(d < n.id and d in ids for d in [*n.ctrl_deps, *n.data_deps])
            assert len(set(n.data_deps)) == len(n.data_deps) and len(set(n.ctrl_deps)) == len(n.ctrl_deps)
            assert attrs(n)["is_cpu_op"] is False and n.type in (pb.COMP_NODE, pb.COMM_COLL_NODE,
                                                                  pb.COMM_SEND_NODE, pb.COMM_RECV_NODE)
            if n.type != pb.COMP_NODE or attrs(n)["aiflame_wall_ns"] >= 1000:
                assert n.duration_micros >= 1
        assert nodes[0].type == pb.COMM_COLL_NODE  # the start-up before the first collective is not charged
        comp = [n for n in nodes if n.type == pb.COMP_NODE]
        assert comp and all(n.duration_micros * 1000 <= attrs(n)["aiflame_wall_ns"] + 1000 for n in comp)
        # some compute ran while communication was in flight (DDP's all-reduces overlap the backward pass)
        assert any("forward" in n.name or "backward" in n.name for n in comp), [n.name for n in comp]


def test_network_and_perfetto_timeline(job: Job) -> None:
    # Oracle: the program's own record (12 steps of collectives, 2 point-to-point messages); Perfetto's schema
    out, _ = job
    net = (out / "profile.network.yml").read_text()
    assert "topology: [ Switch ]" in net and "npus_count: [ 2 ]" in net
    doc = json.loads((out / "profile.perfetto.json").read_text())
    tracks = check_trace_events(doc)
    same_timeline(doc, (out / "profile.pftrace").read_bytes())  # the protobuf timeline is the same one
    cats = Counter(e["cat"] for evs in tracks.values() for e in evs)
    assert cats["compute"] and cats["collective"] >= 2 * 12 and cats["p2p"] == 4 and cats["wait"]


def test_export_check_obfuscated_and_report(job: Job, tmp_path: Path) -> None:
    # Oracle: the program's own record (uneven all-to-all, one-way sends); mlc-chakra's decoder
    out, ranks = job
    capture = out / "profile.aiflame"
    key = tmp_path / "key"
    exported = aiflame("export", str(capture), "-f", "chakra", "-o", str(tmp_path / "job"), "--obfuscate",
                       "--key-file", str(key))
    assert "network fitted" in exported.stdout and "rule" not in exported.stderr
    aiflame("export", str(capture), "-f", "folded", "-o", str(tmp_path / "job.folded"), "--obfuscate",
            "--key-file", str(key))
    assert "every rule" in aiflame("chakra", "check", str(tmp_path / "job")).stdout
    plain, hidden = load(sorted(out.glob("profile.*.et"))), load(sorted(tmp_path.glob("job.*.et")))
    for r in plain:
        assert len(plain[r]) == len(hidden[r])
        assert [(n.type, attrs(n).get("comm_size")) for n in comm(plain[r])] == \
            [(n.type, attrs(n).get("comm_size")) for n in comm(hidden[r])]
    text = " ".join(n.name for nodes in hidden.values() for n in nodes) + (tmp_path / "job.folded").read_text()
    for secret in ("forward", "backward", "ddp_gloo", "python", "libtorch", ".py"):
        assert secret not in text
    report = aiflame("report", "comm", str(capture), "--plot", str(tmp_path / "comm.svg")).stdout
    flagged = {line.split(":")[0].strip() for line in report.splitlines()
               if " bytes " in line and " vs median " in line}
    assert flagged == {"alltoallv", "send", "recv"}  # the uneven splits and the per-rank message sizes
    assert (tmp_path / "comm.svg").read_text().count('stroke="#d62728"') == 6


def test_a_network_calibrated_on_a_sweep_exports_the_job(job: Job, tmp_path: Path) -> None:
    """Issue #31, on real captures: a size sweep (every gloo collective and send/recv at 4 KiB .. 1 MiB) calibrated
    into a network file that names the sweep's capture; the DDP job exported with it holds a host-cost node before
    each call and keeps the simulator's input rules; `report sim` calls it a prediction (the replay itself is
    ASTRA-sim's, by hand: docs/chakra.md)."""
    # Oracle: the sweep's own call sizes (5 per kind); mlc-chakra's decoder (ASTRA-sim's run is by hand)
    out, _ = job
    aiflame("profile", "-o", str(tmp_path / "sweep"), "-q", "-F", "99", "--formats", "folded", "--",
            sys.executable, str(REPO / "examples" / "comm_jobs.py"), "sweep", "--reps", "2", "--max-kib", "1024",
            timeout=150)
    net = tmp_path / "host.network.yml"
    told = aiflame("chakra", "calibrate", str(tmp_path / "sweep" / "profile.aiflame"), "-o", str(net)).stdout
    for kind in ("allreduce", "allgather", "broadcast", "alltoall", "send/recv"):
        assert re.search(rf"{re.escape(kind)}\s+[\d.]+ µs \+ [\d.e+-]+ ns/B\s+\(\d+ calls, 5 sizes\)", told), told
    text = net.read_text()
    assert "calibrated by aiflame on capture" in text and "aiflame-calibration:" in text
    exported = aiflame("export", str(out / "profile.aiflame"), "-f", "chakra", "-o", str(tmp_path / "job"),
                       "--opt", f"network={net}")
    assert "calibrated on capture" in exported.stdout
    for call, kind in (("reduce", "allreduce"), ("gather", "allgather"), ("scatter", "allgather")):
        assert f"{call}: not in the calibration, costed as {kind}" in exported.stderr
    assert (tmp_path / "job.network.yml").read_text() == text
    assert "every rule" in aiflame("chakra", "check", str(tmp_path / "job")).stdout
    for nodes in load(sorted(tmp_path.glob("job.*.et"))).values():
        by_id = {n.id: n for n in nodes}
        calls = comm(nodes)
        assert calls
        for n in calls:
            hosts = [by_id[d] for d in n.data_deps if by_id[d].name.startswith("host: ")]
            assert len(hosts) == 1 and hosts[0].type == pb.COMP_NODE and hosts[0].duration_micros >= 0, n.name
    log = tmp_path / "sim.log"
    log.write_text("".join(f"sys[{r}] finished, 1000 cycles, exposed communication 10 cycles.\n" for r in (0, 1)))
    report = aiflame("report", "sim", str(out / "profile.aiflame"), str(log), "--network", str(net)).stdout
    assert "held out" in " ".join(report.split())

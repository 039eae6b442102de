"""Chakra traces, the balance report and obfuscation from a real 2-rank gloo DDP job (examples/ddp_gloo.py, CPU
PyTorch) captured under `aiflame profile` as root: every `.et` decodes with mlc-chakra's decoder, holds exactly
the communication the program says it made (types, sizes, peers, counts), passes the simulator's load rules and
replays with its peer to the end; the report flags the deliberately uneven ranks."""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import REPO
from tests.integration.conftest import aiflame
from tests.unit.test_chakra_replay import attrs, load, pb, replay

STEPS = 3
Job = tuple[Path, dict[int, dict[str, Any]]]  # output directory, the program's account by rank

COLL = {"allreduce": pb.ALL_REDUCE, "allgather": pb.ALL_GATHER, "broadcast": pb.BROADCAST,
        "alltoallv": pb.ALL_TO_ALL}


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> Job:
    tmp = tmp_path_factory.mktemp("chakra")
    expect = tmp / "expect.jsonl"
    aiflame("profile", "-o", str(tmp / "out"), "-q", "--formats", "folded,chakra", "--", sys.executable,
            str(REPO / "examples" / "ddp_gloo.py"), "--steps", str(STEPS), "--expect", str(expect), timeout=150)
    ranks = {}
    for line in expect.read_text().splitlines():
        rec = json.loads(line)
        ranks[rec["rank"]] = rec
    assert sorted(ranks) == [0, 1]
    return tmp / "out", ranks


def expected_nodes(rank: int, world: int, collectives: list[dict[str, Any]]) -> Counter[tuple[Any, ...]]:
    """(name, type, comm_type, size, src, dst) of the communication nodes the program's collectives become."""
    out: Counter[tuple[Any, ...]] = Counter()
    for c in collectives:
        kind, size, peer, root = c["type"], c["bytes"], c["peer"], c["root"]
        if kind in COLL:
            out[(kind, pb.COMM_COLL_NODE, COLL[kind], size, None, None)] += 1
        elif kind == "send":
            out[(kind, pb.COMM_SEND_NODE, None, size, rank, peer)] += 1
        elif kind == "recv":
            out[(kind, pb.COMM_RECV_NODE, None, size, peer, rank)] += 1
        else:  # made of messages to or from the root (rank 0 for a barrier)
            if kind == "barrier":
                root, size = 0, 0
            to_root = kind in ("reduce", "gather", "barrier")
            from_root = kind in ("scatter", "barrier")
            others = [r for r in range(world) if r != root]
            if rank == root:
                for r in others:
                    if to_root:
                        out[(f"{kind}:recv", pb.COMM_RECV_NODE, None, size, r, rank)] += 1
                    if from_root:
                        out[(f"{kind}:send", pb.COMM_SEND_NODE, None, size, rank, r)] += 1
            else:
                if to_root:
                    out[(f"{kind}:send", pb.COMM_SEND_NODE, None, size, rank, root)] += 1
                if from_root:
                    out[(f"{kind}:recv", pb.COMM_RECV_NODE, None, size, root, rank)] += 1
    return out


def _got(nodes: list[Any]) -> Counter[tuple[Any, ...]]:
    return Counter((n.name, n.type, attrs(n).get("comm_type"), attrs(n).get("comm_size"), attrs(n).get("comm_src"),
                    attrs(n).get("comm_dst")) for n in nodes if n.type != pb.COMP_NODE)


def test_traces_hold_exactly_the_programs_communication(job: Job) -> None:
    out, ranks = job
    files = sorted(out.glob("profile.*.et"))
    assert [f.name for f in files] == ["profile.0.et", "profile.1.et"]
    traces = load(files)
    for r, rec in ranks.items():
        want = expected_nodes(r, rec["world_size"], rec["collectives"])
        got = _got(traces[r])
        assert got == want, f"rank {r}: missing {want - got}, extra {got - want}"
    replay(traces)  # also checks ids, dependencies, DAG, node types and attribute slots


def test_timings_consistent_with_the_capture(job: Job) -> None:
    out, _ = job
    traces = load(sorted(out.glob("profile.*.et")))
    for nodes in traces.values():
        by_id = {n.id: n for n in nodes}
        for n in nodes:
            for d in n.ctrl_deps:  # program order: a predecessor started no later
                assert by_id[d].start_time_micros <= n.start_time_micros
            for d in n.data_deps:  # a producer started before; what a CPU interval waited for had ended
                p = by_id[d]
                assert p.start_time_micros <= n.start_time_micros
                if "num_samples" in attrs(n) and p.type != pb.COMP_NODE:
                    assert p.start_time_micros + p.duration_micros <= n.start_time_micros + 1
        cpu = [n for n in nodes if n.type == pb.COMP_NODE and attrs(n)["is_cpu_op"]]
        assert sum(attrs(n).get("num_samples", 0) for n in cpu) > 0
        assert any("forward" in n.name or "backward" in n.name for n in cpu), [n.name for n in cpu]


def test_export_obfuscated_and_report(job: Job, tmp_path: Path) -> None:
    out, ranks = job
    capture = out / "profile.aiflame"
    key = tmp_path / "key"
    aiflame("export", str(capture), "-f", "chakra", "-o", str(tmp_path / "job"), "--obfuscate", "--key-file",
            str(key))
    aiflame("export", str(capture), "-f", "folded", "-o", str(tmp_path / "job.folded"), "--obfuscate",
            "--key-file", str(key))
    plain, hidden = load(sorted(out.glob("profile.*.et"))), load(sorted(tmp_path.glob("job.*.et")))
    for r in plain:
        assert len(plain[r]) == len(hidden[r]) and _got(plain[r]) == _got(hidden[r])
    text = " ".join(n.name for nodes in hidden.values() for n in nodes) + (tmp_path / "job.folded").read_text()
    for secret in ("forward", "backward", "ddp_gloo", "python", "libtorch", ".py"):
        assert secret not in text
    report = aiflame("report", "comm", str(capture), "--plot", str(tmp_path / "comm.svg")).stdout
    flagged = {line.split(":")[0].strip() for line in report.splitlines()
               if " bytes " in line and " vs median " in line}
    assert flagged == {"alltoallv", "send", "recv"}  # the uneven splits and the per-rank message sizes
    assert (tmp_path / "comm.svg").read_text().count('stroke="#d62728"') == 6

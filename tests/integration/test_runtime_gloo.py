"""gloo collectives of a real 2-rank DDP job (examples/ddp_gloo.py, CPU PyTorch): per rank, the capture must hold
exactly the collectives the program says it made (type, bytes, peer, root), on the right rank, each with a start
and an end, and no layout warning."""

from __future__ import annotations

import importlib.util
import json
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from aiflame.agent.runtimes.gloo import GlooRuntime
from aiflame.core.capture import read_capture
from aiflame.core.raw import RawEvent
from aiflame.symbolize.objfmt.elf import ElfFile
from tests.conftest import REPO
from tests.integration.conftest import aiflame

STEPS = 4
Run = tuple[list[RawEvent], dict[int, dict[str, Any]]]  # gloo events, the program's account by pid


def _libtorch_cpu() -> Path:
    spec = importlib.util.find_spec("torch")
    if spec is None or spec.origin is None:
        pytest.fail("torch is not installed in this interpreter (pip install torch==2.13.0, the accel-test extra)")
    return Path(spec.origin).parent / "lib" / "libtorch_cpu.so"


def test_every_probed_symbol_is_in_libtorch_cpu() -> None:
    with ElfFile.open(_libtorch_cpu()) as elf:
        specs = GlooRuntime().specs()
        found = elf.function_addresses({s for spec in specs for s in spec.symbols})
    missing = [spec.call for spec in specs if not any(s in found for s in spec.symbols)]
    assert not missing


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    """Profile the DDP job once: the capture's events, and the program's own account by pid."""
    tmp = tmp_path_factory.mktemp("gloo")
    expect = tmp / "expect.jsonl"
    aiflame("profile", "-o", str(tmp / "out"), "-q", "--formats", "folded", "--", sys.executable,
            str(REPO / "examples" / "ddp_gloo.py"), "--steps", str(STEPS), "--expect", str(expect), timeout=150)
    ranks = {}
    for line in expect.read_text().splitlines():
        rec = json.loads(line)
        ranks[rec["pid"]] = rec
    assert sorted(r["rank"] for r in ranks.values()) == [0, 1]
    events = [e for e in read_capture(tmp / "out" / "profile.aiflame").events if e.runtime == "gloo"]
    return events, ranks


def test_collectives_per_rank_match_the_program(ddp_run: Run) -> None:
    # Oracle: the program's own record of its collectives (examples/ddp_gloo.py)
    events, ranks = ddp_run
    for pid, rec in ranks.items():
        want = Counter((c["type"], c["bytes"], c["peer"], c["root"]) for c in rec["collectives"])
        got = Counter((e.call, e.args.get("bytes"), e.args.get("peer"), e.args.get("root"))
                      for e in events if e.pid == pid and e.kind == "collective")
        assert got == want, f"rank {rec['rank']}: missing {want - got}, extra {got - want}"


def test_rank_world_size_times_and_layouts(ddp_run: Run) -> None:
    # Oracle: the program's own record (its rank, world size 2, two messages)
    events, ranks = ddp_run
    for pid, rec in ranks.items():
        mine = [e for e in events if e.pid == pid]
        contexts = [e for e in mine if e.call == "context"]
        assert [(e.kind, e.args["rank"], e.args["world_size"]) for e in contexts] == [("meta", rec["rank"], 2)]
        for e in mine:
            assert (e.args["rank"], e.args["world_size"]) == (rec["rank"], 2), e
            assert "layout" not in e.strs, e.strs
            if e.kind in ("collective", "sync"):
                assert 0 < e.start_ns < e.end_ns, e
        waits = Counter((e.call, e.args["peer"], e.args["bytes"]) for e in mine if e.kind == "sync")
        p2p = Counter((e.call + "_wait", e.args["peer"], e.args["bytes"]) for e in mine if e.call in ("send", "recv"))
        assert waits == p2p and len(p2p) == 2
        # the algorithms run on the process group's worker threads, send/recv on the caller's
        assert all(e.tid != pid for e in mine if e.kind == "collective" and e.call not in ("send", "recv"))
        assert not [e for e in mine if e.kind == "other"]  # every transport call was inside a collective

"""NCCL probes on a real program linked against the NCCL wheel's libnccl.so.2 (no GPU: communicator
constructors fail inside CUDA initialization and collectives on a NULL communicator return ncclInvalidArgument,
after the probed entry points ran). tests/programs/nccl_calls.c prints each call it made with its return value;
the capture must hold exactly those calls, with their arguments, return values and launch stacks."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from collections import Counter
from pathlib import Path

import pytest

from aiflame.core.capture import read_capture
from aiflame.core.model import EventKind
from aiflame.core.raw import Capture, RawEvent
from aiflame.symbolize.stacks import StackOptions, symbolize_capture
from tests.conftest import REPO
from tests.integration.conftest import aiflame

SOURCE = REPO / "tests" / "programs" / "nccl_calls.c"
STREAM_A, STREAM_B = 0x5151, 0x5252
# (call, count) -> arguments the event must carry (each collective in the program has its own count)
COLLECTIVE_ARGS: dict[tuple[str, int], dict[str, int]] = {
    ("ncclAllReduce", 1000): {"dtype": 7, "bytes": 4000, "op": 0, "comm": 0, "stream": STREAM_A},
    ("ncclAllReduce", 500): {"dtype": 7, "bytes": 2000, "op": 4, "comm": 0, "stream": 0, "config": 0},
    ("ncclAllGather", 100): {"dtype": 4, "bytes": 800, "comm": 0, "stream": STREAM_B},
    ("ncclReduceScatter", 256): {"dtype": 6, "bytes": 512, "op": 2, "comm": 0, "stream": 0},
    ("ncclBroadcast", 10): {"dtype": 0, "bytes": 10, "root": 1, "comm": 0, "stream": STREAM_A},
    ("ncclBcast", 33): {"dtype": 1, "bytes": 33, "root": 0, "comm": 0, "stream": 0},
    ("ncclReduce", 64): {"dtype": 8, "bytes": 512, "op": 3, "root": 1, "comm": 0, "stream": STREAM_B},
    ("ncclAlltoAll", 8): {"dtype": 9, "bytes": 16, "comm": 0, "stream": 0},
    ("ncclSend", 10): {"dtype": 2, "bytes": 40, "peer": 1, "comm": 0, "stream": 0, "grouped": 1},
    ("ncclRecv", 20): {"dtype": 2, "bytes": 80, "peer": 0, "comm": 0, "stream": 0, "grouped": 1},
}
RENAMED = {"ncclAllReduceConfig": "ncclAllReduce"}  # Config variants report their plain name
HELPERS = {"ncclSend": "point_to_point", "ncclRecv": "point_to_point"}  # the others run in collectives()


def _libnccl() -> Path:
    roots = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"], *sys.path}
    for root in sorted(r for r in roots if r):
        lib = Path(root) / "nvidia" / "nccl" / "lib" / "libnccl.so.2"
        if lib.is_file():
            return lib
    pytest.fail("libnccl.so.2 not found: install the accel-test extra (`make setup`)")


@pytest.fixture(scope="module")
def program(tmp_path_factory: pytest.TempPathFactory) -> Path:
    lib = _libnccl()
    out = tmp_path_factory.mktemp("nccl") / "nccl_calls"
    cmd = ["gcc", "-O0", "-g", "-fno-omit-frame-pointer", "-o", str(out), str(SOURCE), str(lib),
           f"-Wl,-rpath,{lib.parent}"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.fail(f"gcc failed: {' '.join(cmd)}\n{proc.stderr}")
    return out


# On a machine with a GPU, communicator creation would wait for the other (absent) rank: hide the GPUs.
NO_GPU = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}


@pytest.fixture(scope="module")
def made(program: Path) -> list[tuple[str, int]]:
    """(call, return value) as the program reports them, run without the profiler."""
    proc = subprocess.run([str(program)], capture_output=True, text=True, timeout=60, check=True, env=NO_GPU)
    calls = []
    for line in proc.stdout.splitlines():
        name, _, ret = line.partition(" ")
        if ret != "skipped":
            calls.append((RENAMED.get(name, name), int(ret)))
    return calls


@pytest.fixture(scope="module")
def capture(program: Path, tmp_path_factory: pytest.TempPathFactory) -> Capture:
    out = tmp_path_factory.mktemp("nccl_profile")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CUDA_VISIBLE_DEVICES", "")
        aiflame("profile", "-o", str(out), "-q", "--formats", "folded", "--", str(program))
    return read_capture(out / "profile.aiflame")


def _nccl(cap: Capture) -> list[RawEvent]:
    return [e for e in cap.events if e.runtime == "nccl"]


def test_every_call_seen_once_with_its_return_value(made: list[tuple[str, int]], capture: Capture) -> None:
    # Oracle: the program's own printout of each call it made and what NCCL returned
    assert ("ncclAllReduce", 4) in made and ("ncclCommInitRank", 0) not in made  # no GPU: as expected here
    events = _nccl(capture)
    assert Counter((e.call, e.args.get("ret")) for e in events) == Counter(made)
    assert all(e.end_ns >= e.start_ns > 0 for e in events)


def test_collective_arguments(capture: Capture) -> None:
    # Oracle: the program's own printout of each call's arguments (tests/programs/nccl_calls.c)
    events = [e for e in _nccl(capture) if e.kind == "collective"]
    assert events
    for e in events:
        want = COLLECTIVE_ARGS[(e.call, e.args["count"])]
        assert {k: e.args.get(k) for k in want} == want, (e.call, e.args)
        assert "rank" not in e.args  # no communicator was created
    by_call = Counter(e.call for e in events)
    assert by_call["ncclAllReduce"] >= 3 and by_call["ncclBroadcast"] == 1 and by_call["ncclBcast"] == 1
    assert {e.strs["dtype"] for e in events} >= {"float32", "int64", "float16", "int8", "uint8", "float64"}
    assert {e.strs.get("op") for e in events} >= {"sum", "max", "min"}


def test_communicator_requests(capture: Capture) -> None:
    # Oracle: the program's own printout (ranks, ids, comm names, split colours)
    meta = {e.call: e for e in _nccl(capture) if e.kind == "meta"}
    init = meta["ncclCommInitRank"]
    # rank is the third integer register because the 128-byte unique id went on the stack, where its first
    # 8 bytes were read
    assert (init.args["rank"], init.args["nranks"], init.strs["comm_id"]) == (1, 2, "1122334455667788")
    assert init.args["ret"] != 0 and "world_size" not in init.args and "comm" not in init.args
    cfg = meta["ncclCommInitRankConfig"]
    assert (cfg.args["rank"], cfg.args["nranks"], cfg.strs["comm_name"]) == (3, 4, "tp-group")
    assert cfg.strs["comm_id"] == "1122334455667788"
    assert meta["ncclCommInitAll"].args["nranks"] == 2
    split = meta["ncclCommSplit"]
    assert (split.args["color"], split.args["key"], split.args["comm"]) == (5, 7, 0)
    assert meta["ncclCommDestroy"].args == {"comm": 0, "ret": 0}
    assert (meta["ncclGroupStart"].args["depth"], meta["ncclGroupEnd"].args["depth"]) == (1, 0)
    for name in ("ncclCommInitRank", "ncclCommInitRankConfig", "ncclCommInitAll", "ncclCommSplit"):
        assert len(meta[name].user) >= 3, name  # the caller's stack: libnccl, make_communicators, ...


def test_collective_stacks(capture: Capture) -> None:
    # Oracle: the program's structure: main -> run_calls -> one helper per collective
    prof = symbolize_capture(capture, options=StackOptions(group="none"))
    colls = [e for e in prof.events if e.kind == EventKind.COLLECTIVE and e.args.get("runtime") == "nccl"]
    assert len(colls) >= 10
    for e in colls:
        names = [f.name for f in e.stack]
        helper = HELPERS.get(str(e.args["call"]), "collectives")
        assert names.index("main") < names.index("run_calls") < names.index(helper), names
        assert e.duration_ns > 0

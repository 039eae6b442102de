"""Level Zero probes on a real program linked against Debian's loader (libze1, no driver: zeInit fails and every
entry point returns ZE_RESULT_ERROR_UNINITIALIZED after the probed loader function ran). tests/programs/
ze_calls.c prints each call it made with its return value; the capture must hold exactly those calls (zeInit is
not probed), with their arguments, the module binary, kernel names carried to launches, and launch stacks."""

from __future__ import annotations

import hashlib
import subprocess
from collections import Counter
from pathlib import Path

import pytest

from aiflame.core.capture import read_capture
from aiflame.core.model import EventKind
from aiflame.core.raw import Capture, RawEvent
from aiflame.symbolize.stacks import StackOptions, symbolize_capture
from tests.conftest import REPO
from tests.integration.conftest import aiflame, read_folded

SOURCE = REPO / "tests" / "programs" / "ze_calls.c"
ZEBIN = bytes([0x7F, ord("E"), ord("L"), ord("F"), 2, 1, 1]) + bytes(57) + b"zebin" + bytes(187)  # as ze_calls.c
LIST, QUEUE, EVENT, FENCE, MODULE, KERNEL_A, KERNEL_B = 0x3000, 0x4000, 0x5000, 0x6000, 0x7000, 0x8000, 0x9000
HELPERS = {"compute": "launch_step", "copy": "launch_step", "other": "submit_and_wait", "sync": "submit_and_wait"}


@pytest.fixture(scope="module")
def program(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("ze") / "ze_calls"
    cmd = ["gcc", "-O0", "-g", "-fno-omit-frame-pointer", "-o", str(out), str(SOURCE), "-lze_loader"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.fail(f"gcc failed (needs libze-dev, `make setup`): {' '.join(cmd)}\n{proc.stderr}")
    return out


@pytest.fixture(scope="module")
def made(program: Path) -> list[tuple[str, int]]:
    """(call, return value) as the program reports them, run without the profiler."""
    proc = subprocess.run([str(program)], capture_output=True, text=True, timeout=60, check=True)
    calls = [(name, int(ret, 16)) for name, _, ret in (line.partition(" ") for line in proc.stdout.splitlines())]
    return [c for c in calls if c[0] != "zeInit"]


@pytest.fixture(scope="module")
def out_dir(program: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("ze_profile")
    aiflame("profile", "-o", str(out), "-q", "--formats", "folded", "--", str(program))
    return out


@pytest.fixture(scope="module")
def capture(out_dir: Path) -> Capture:
    return read_capture(out_dir / "profile.aiflame")


def _ze(cap: Capture, call: str = "") -> list[RawEvent]:
    return [e for e in cap.events if e.runtime == "level_zero" and (not call or e.call == call)]


def test_every_call_seen_once_with_its_return_value(made: list[tuple[str, int]], capture: Capture) -> None:
    # Oracle: the program's own printout of each call it made and what it returned
    assert made and all(ret == 0x78000001 for _, ret in made)  # no driver: ZE_RESULT_ERROR_UNINITIALIZED
    events = _ze(capture)
    assert Counter((e.call, e.args.get("ret")) for e in events) == Counter(made)
    assert all(e.end_ns >= e.start_ns > 0 for e in events)


def test_module_binary_is_kept(capture: Capture) -> None:
    # Oracle: the program's printout and the zebin bytes it passed (sha256 by hashlib)
    (ev,) = _ze(capture, "zeModuleCreate")
    digest = hashlib.sha256(ZEBIN).hexdigest()
    assert {k: ev.args.get(k) for k in ("context", "device", "format", "size", "module")} == {
        "context": 0x1000, "device": 0x2000, "format": 1, "size": len(ZEBIN), "module": MODULE}
    assert (ev.strs["build_flags"], ev.strs["image"], ev.strs["digest"]) == ("-g -O2", "zebin", digest)
    (code,) = [c for c in capture.gpu_code if c.digest == digest]
    assert code.kind == "zebin" and code.origin.startswith("memory of pid ") and code.data in (ZEBIN, b"")
    assert len(ev.user) >= 3


def test_kernels_named_at_launch(capture: Capture) -> None:
    # Oracle: the program's printout (kernel names and handles, group counts)
    created = {e.args["kernel"]: e.strs["name"] for e in _ze(capture, "zeKernelCreate")}
    assert created == {KERNEL_A: "vector_add", KERNEL_B: "reduce_rows"}
    digest = hashlib.sha256(ZEBIN).hexdigest()
    launches = [e for e in _ze(capture) if e.kind == "compute"]
    seen = Counter((e.call, e.strs.get("name"), e.args["group_x"], e.args["group_y"], e.args["group_z"],
                    e.args["kernel"]) for e in launches)
    assert seen == {("zeCommandListAppendLaunchKernel", "vector_add", 64, 2, 1, KERNEL_A): 3,
                    ("zeCommandListAppendLaunchCooperativeKernel", "reduce_rows", 7, 5, 3, KERNEL_B): 1}
    for e in launches:
        assert e.args["command_list"] == LIST and e.strs["module_digest"] == digest
    assert {e.args["signal_event"] for e in launches} == {EVENT, 0}


def test_copies_submission_and_syncs(capture: Capture) -> None:
    # Oracle: the program's printout (sizes, queues, fences, timeouts)
    copies = sorted((e.call, e.args["bytes"]) for e in _ze(capture) if e.kind == "copy")
    assert copies == [("zeCommandListAppendMemoryCopy", 4096), ("zeCommandListAppendMemoryCopy", 65536),
                      ("zeCommandListAppendMemoryFill", 1024)]
    (ex,) = _ze(capture, "zeCommandQueueExecuteCommandLists")
    assert {k: ex.args[k] for k in ("command_queue", "num_lists", "fence", "command_list")} == {
        "command_queue": QUEUE, "num_lists": 1, "fence": FENCE, "command_list": LIST}
    syncs = {e.call: e.args for e in _ze(capture) if e.kind == "sync"}
    assert syncs["zeCommandQueueSynchronize"]["command_queue"] == QUEUE
    assert syncs["zeCommandQueueSynchronize"]["timeout"] == -1  # UINT64_MAX in the capture's sint64
    assert (syncs["zeEventHostSynchronize"]["event"], syncs["zeEventHostSynchronize"]["timeout"]) == (EVENT, 1000)
    assert (syncs["zeFenceHostSynchronize"]["fence"], syncs["zeFenceHostSynchronize"]["timeout"]) == (FENCE, 2000)


def test_stacks(capture: Capture) -> None:
    # Oracle: the program's structure: main -> run_calls -> one helper per kind of call
    prof = symbolize_capture(capture, options=StackOptions(group="none"))
    events = [e for e in prof.events if e.args.get("runtime") == "level_zero"]
    assert len(events) == 11  # 4 launches, 2 copies, 1 fill, 1 submission, 3 syncs (meta events are not here)
    for e in events:
        names = [f.name for f in e.stack]
        assert names.index("main") < names.index("run_calls") < names.index(HELPERS[e.kind.value]), names
    kernels = Counter(e.name for e in events if e.kind == EventKind.COMPUTE)
    assert kernels == {"vector_add": 3, "reduce_rows": 1}


def test_launch_view_names_the_kernels(out_dir: Path) -> None:
    # Oracle: the program's printout: vector_add launched 3 times, reduce_rows once
    by_kernel = Counter[str]()
    for stack, n in read_folded(out_dir / "launches.folded").items():
        frames = stack.split(";")
        assert frames[-2] == "-" and "launch_step" in frames
        by_kernel[frames[-1].removesuffix("_[G]")] += n
    assert by_kernel == {"vector_add": 3, "reduce_rows": 1}

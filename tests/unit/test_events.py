"""Runtime events through the capture file and into the model: names, ranks, the launch view."""

from __future__ import annotations

from pathlib import Path

from aiflame.core.capture import read_capture, write_capture
from aiflame.core.model import EventKind, FrameKind
from aiflame.core.raw import Capture, CaptureFooter, CaptureHeader, GpuCode, RawEvent, RawPyFrame
from aiflame.symbolize.events import launch_profile, ranks
from aiflame.symbolize.stacks import StackOptions, symbolize_capture


def _capture() -> Capture:
    cap = Capture(CaptureHeader(1, target="test"))
    cap.events = [
        RawEvent("cuda", "__cudaRegisterFunction", "meta", 10, 10, 1, args={"func": 0x1234, "handle": 7},
                 strs={"name": "_Z5scalePffi"}),
        RawEvent("cuda", "cudaLaunchKernel", "compute", 10, 11, 100, 150, (0xAAA, 0xBBB), args={"func": 0x1234}),
        RawEvent("cuda", "cudaLaunchKernel", "compute", 10, 11, 200, 260, (0xAAA, 0xBBB), args={"func": 0x1234}),
        RawEvent("cuda", "cudaMemcpy", "copy", 10, 11, 300, 400, args={"bytes": 4096}, strs={"direction": "HtoD"}),
        RawEvent("gloo", "context", "meta", 20, 20, 5, args={"rank": 1, "world_size": 2}),
        RawEvent("gloo", "allreduce", "collective", 20, 21, 500, 900, args={"bytes": 80},
                 py=(RawPyFrame(0x99, 0),), py_flags=3),
    ]
    cap.gpu_code = [GpuCode("ab" * 32, "cubin", 90, "/x/prog", b"\x7fELF...")]
    cap.footer = CaptureFooter()
    return cap


def test_events_and_gpu_code_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "c.aiflame"
    cap = _capture()
    write_capture(path, cap)
    back = read_capture(path)
    assert back.events == cap.events
    assert back.gpu_code == cap.gpu_code


def test_trace_events_named_ranked_and_meta_dropped() -> None:
    # Oracle: by construction — the raw events built here (a registered kernel name, a gloo context's rank)
    prof = symbolize_capture(_capture(), options=StackOptions(group="none"))
    assert [(e.name, e.kind) for e in prof.events] == [
        ("scale", EventKind.COMPUTE), ("scale", EventKind.COMPUTE), ("cudaMemcpy", EventKind.COPY),
        ("allreduce", EventKind.COLLECTIVE)]
    assert prof.events[0].duration_ns == 50
    assert [e.rank for e in prof.events] == [-1, -1, -1, 1]
    assert prof.events[2].args["direction"] == "HtoD"
    assert ranks(_capture()) == {20: (1, 2)}


def test_launch_view_is_stack_separator_kernel() -> None:
    # Oracle: by construction — two launches of the kernel registered as scale, built here
    prof = symbolize_capture(_capture(), options=StackOptions(group="none"))
    view = launch_profile(prof)
    assert view.unit == "launches" and view.total_weight == 2
    (stack, n), = view.aggregate().items()
    assert n == 2
    assert [f.kind for f in stack[-2:]] == [FrameKind.SEPARATOR, FrameKind.ACCEL_SOURCE]
    assert stack[-1].name == "scale"
    # no mappings in this capture: the stack is kept, as one unnamed frame (an unmapped address ends a chain)
    assert [f.kind for f in stack[:-2]] == [FrameKind.UNKNOWN]

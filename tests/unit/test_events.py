"""Runtime events through the capture file and into the model: names, ranks, the launch view."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from aiflame.core.capture import read_capture, write_capture
from aiflame.core.model import EventKind, Frame, FrameKind
from aiflame.core.raw import (
    Capture,
    CaptureFooter,
    CaptureHeader,
    GpuCode,
    Mapping,
    ProcessSnapshot,
    RawEvent,
    RawPyFrame,
)
from aiflame.symbolize.events import launch_profile, ranks
from aiflame.symbolize.native import NativeSymbolizer
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
    assert ranks(_capture().events) == {20: (1, 2)}


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


class _StubNames(NativeSymbolizer):
    """/fake/app's function `scale_stub` at file offset 0x100 only (0xff would be the look-up of a return address)."""

    def symbolize(self, path: str, build_id: str | None, file_offsets: Iterable[int]) -> dict[int, Frame]:
        return {off: Frame("scale_stub", module="app") for off in file_offsets if (path, off) == ("/fake/app", 0x100)}


def test_a_kernel_is_named_by_its_host_address() -> None:
    """A launch's `func` is looked up as the address it is (not as a return address) in the mappings of its time;
    one in no file (or none) is named by its registration, else by the address."""
    # Oracle: by construction: the mappings, registration and addresses are laid out here, names from a stub
    cap = Capture(CaptureHeader(1, target="test"))
    cap.processes = [ProcessSnapshot(10, 0, [Mapping(0x1000, 0x2000, 0, "/fake/app"),
                                             Mapping(0x3000, 0x4000, 0, "[anon:jit]")])]
    funcs = (0x1100, 0x3010, 0x9000, 0x1101)
    cap.events = [RawEvent("cuda", "__cudaRegisterFunction", "meta", 10, 10, 1, args={"func": 0x3010},
                           strs={"name": "_Z3jitv"})]
    cap.events += [RawEvent("cuda", "cudaLaunchKernel", "compute", 10, 10, 10 + i, 20 + i, (0x1100,), args={"func": f})
                   for i, f in enumerate(funcs)]
    prof = symbolize_capture(cap, _StubNames(), StackOptions(group="none"))
    assert [e.name for e in prof.events] == ["scale_stub", "jit", "[kernel 0x9000]", "[kernel 0x1101]"]

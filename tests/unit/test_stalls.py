"""The stall merge: stall samples at real instruction offsets of real cubins, attributed to launch stacks."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aiflame.core.model import EventKind, Frame, FrameKind, Profile, Sample, TraceEvent
from aiflame.core.raw import Capture, CaptureFooter, CaptureHeader, GpuCode, RawStallSample
from aiflame.exporters.folded import folded_lines
from aiflame.symbolize.accel.cubin import parse_cubin
from aiflame.symbolize.accel.fatbin import iter_entries, read_fatbin_file
from aiflame.symbolize.stalls import (
    STALL_UNIT,
    _diffuse,
    combined_profile,
    reason_label,
    share,
    stall_profile,
)
from tests.cuda_build import KernelPrograms, kernel_programs
from tests.nvdisasm_read import nvdisasm_lines, nvdisasm_sass, squeeze

SCALE = "_Z5scalePffi"
ADD = "_Z3addPKfS0_Pfi"
LONG_SB = "smsp__pcsamp_warps_issue_stalled_long_scoreboard"
WAIT = "smsp__pcsamp_warps_issue_stalled_wait"


@pytest.fixture(scope="module")
def progs(tmp_path_factory: pytest.TempPathFactory) -> KernelPrograms:
    return kernel_programs(tmp_path_factory)


@pytest.fixture(autouse=True)
def _cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIFLAME_CACHE", str(tmp_path_factory.getbasetemp() / "stall-cache"))


@pytest.fixture(scope="module")
def cubin90(progs: KernelPrograms) -> GpuCode:
    _kind, data = read_fatbin_file(progs.plain)
    e = next(e for e in iter_entries(data) if e.kind == "elf" and e.arch == 90 and b".text._Z5scale" in e.data)
    return GpuCode(e.digest, "cubin", 90, str(progs.plain), e.data)


def _stack(*names: str) -> tuple[Frame, ...]:
    return tuple(Frame(n, FrameKind.PYTHON if n.startswith("py") else FrameKind.NATIVE) for n in names)


MAIN_A = _stack("main", "py_train", "launch_scale", "cudaLaunchKernel")
MAIN_B = _stack("main", "py_eval", "launch_scale", "cudaLaunchKernel")
ADD_ST = _stack("main", "launch_add", "cudaLaunchKernel")


def _launches(pid: int = 7) -> list[TraceEvent]:
    evs = [TraceEvent("scale", EventKind.COMPUTE, i, pid=pid, stack=MAIN_A) for i in range(3)]
    evs.append(TraceEvent("scale", EventKind.COMPUTE, 9, pid=pid, stack=MAIN_B))
    evs.append(TraceEvent("add", EventKind.COMPUTE, 10, pid=pid, stack=ADD_ST, args={"correlation_id": 42}))
    return evs


def _cap(stalls: list[RawStallSample], code: list[GpuCode], counters: dict[str, int] | None = None) -> Capture:
    return Capture(CaptureHeader(1), gpu_code=code, stalls=stalls, footer=CaptureFooter(counters=counters or {}))


def test_reason_labels() -> None:
    assert reason_label(LONG_SB) == "long_scoreboard"
    assert reason_label("sbid") == "sbid" and reason_label("") == "[unknown reason]"


def test_layout_sources_and_sass_at_real_offsets(cubin90: GpuCode) -> None:
    # Oracle: nvdisasm -json (SASS text), nvdisasm -g (lines); the 3:1 launch split by construction
    c = parse_cubin(cubin90.data)
    table = c.lines().table(SCALE)
    offsets = sorted({r.start for r in table})[:6]
    stalls = [RawStallSample("cupti", 7, 0, cubin90.digest, SCALE, off, LONG_SB if i % 2 else WAIT, 4 * (i + 1))
              for i, off in enumerate(offsets)]
    prof = stall_profile(_cap(stalls, [cubin90]), Profile(events=_launches()))
    assert prof.unit == STALL_UNIT and prof.total_weight == sum(s.count for s in stalls)
    raw, src_lines = nvdisasm_sass(c.data), nvdisasm_lines(c.data)[SCALE]
    for s in prof.samples:
        st = s.stack
        cpu, gpu = st[:4], st[4:]
        assert cpu in (MAIN_A, MAIN_B)
        assert [f.kind for f in gpu] == [FrameKind.SEPARATOR, FrameKind.ACCEL_SOURCE, FrameKind.ACCEL_SOURCE,
                                         FrameKind.ACCEL_INSTR, FrameKind.STALL]
        assert gpu[1].name == "scale"
        off = int(gpu[3].name.split()[0], 16)
        file, line = src_lines[off] or ("", 0)  # nvdisasm -g's line of that instruction
        assert gpu[2].file == file and gpu[2].line == line and gpu[2].name.endswith(f"kernels.cu:{line}")
        # nvdisasm itself is the oracle: its own line for that offset holds the frame's instruction text.
        text = gpu[3].name.split(" ", 1)[1]
        assert squeeze(text) == raw[(SCALE, off)], (text, raw[(SCALE, off)])
        assert gpu[4].name in ("long_scoreboard", "wait")
    # 3:1 launches from two stacks: each leaf keeps its count, stacks get ~3/4 and ~1/4 of the total.
    by_cpu = Counter[tuple[Frame, ...]]()
    for s in prof.samples:
        by_cpu[s.stack[:4]] += s.weight
    total = prof.total_weight
    assert abs(by_cpu[MAIN_A] - total * 3 / 4) <= 1 and by_cpu[MAIN_A] + by_cpu[MAIN_B] == total
    assert prof.counters["stall_samples"] == total and prof.counters["stall_shared_by_launches"] == total
    lines = folded_lines((s.stack, s.weight) for s in prof.samples)
    first = lines[0].rsplit(" ", 1)[0].split(";")
    assert first[4:6] == ["-", "scale_[G]"] and first[6].startswith("kernels.cu:") and first[6].endswith("_[G]")
    assert first[7].startswith("+0x") and first[7].endswith("_[g]") and first[8].endswith("_[g]")


def test_correlation_id_wins_over_sharing(cubin90: GpuCode) -> None:
    # Oracle: by construction — stall samples whose correlation id names one launch
    stalls = [RawStallSample("cupti", 7, 0, cubin90.digest, ADD, 0x40, WAIT, 5, correlation_id=42),
              RawStallSample("cupti", 7, 0, cubin90.digest, ADD, 0x40, WAIT, 2, correlation_id=43)]
    prof = stall_profile(_cap(stalls, [cubin90]), Profile(events=_launches()), sass=False)
    assert prof.total_weight == 7 and prof.counters["stall_by_correlation"] == 5
    assert all(s.stack[:3] == ADD_ST for s in prof.samples)  # id 43 unknown: shared over add's launches


def test_unknown_launch_kernel_and_code_are_kept_and_counted(cubin90: GpuCode) -> None:
    # Oracle: by construction — a kernel never launched, a pid with no launch, an unmapped Xe IP
    stalls = [
        RawStallSample("cupti", 7, 0, cubin90.digest, "_Z5neverv", 0x10, WAIT, 3),  # never launched
        RawStallSample("cupti", 8, 0, "", SCALE, 0x10, WAIT, 2),  # other pid: no launch there
        RawStallSample("xe", 0, 0, "", "", 0x1234, "sbid", 4),  # unmapped Xe IP
        RawStallSample("cupti", 7, 0, "f" * 64, SCALE, 0x20, "", 1),  # foreign digest -> only cubin with kernel
        RawStallSample("cupti", 7, 0, "", SCALE, 0x20, WAIT, 0),  # empty record
    ]
    prof = stall_profile(_cap(stalls, [cubin90], {"stall_dropped_records": 2, "lost": 9}),
                         Profile(events=_launches()), sass=False)
    assert prof.total_weight == 10
    c = prof.counters
    assert c["stall_unknown_launch"] == 9 and c["stall_unknown_kernel"] == 4 and c["stall_records_empty"] == 1
    assert c["stall_dropped_records"] == 2 and "lost" not in c
    roots = Counter[str]()
    for s in prof.samples:
        roots[s.stack[0].name] += s.weight
    assert roots == {"[unknown launch pid 7]": 3, "[unknown launch pid 8]": 2, "[unknown launch]": 4,
                     "main": 1}
    xe = next(s for s in prof.samples if s.stack[0].name == "[unknown launch]")
    assert [f.name for f in xe.stack[1:]] == ["-", "[unknown kernel]", "[unknown source]", "+0x1234", "sbid"]
    fallback = next(s for s in prof.samples if s.stack[0].name == "main")
    assert fallback.stack[-2].name.startswith("+0x0020") and fallback.stack[-3].line > 0
    assert fallback.stack[-1].name == "[unknown reason]"


def test_combined_view_keeps_both(cubin90: GpuCode) -> None:
    # Oracle: by construction — 11 CPU samples and 5 stall samples put in here
    cpu = Profile(samples=[Sample(MAIN_A, 11)], events=_launches(), counters={"lost": 1})
    stalls = stall_profile(_cap([RawStallSample("cupti", 7, 0, cubin90.digest, ADD, 0, WAIT, 5)], [cubin90]), cpu,
                           sass=False)
    both = combined_profile(cpu, stalls)
    assert both.unit == "CPU + stall samples" and both.total_weight == 16
    assert both.counters["lost"] == 1 and both.counters["stall_samples"] == 5


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 10**6), st.lists(st.integers(1, 1000), min_size=1, max_size=8))
def test_share_is_exact(total: int, weights: list[int]) -> None:
    # Oracle: arithmetic: each part within 1 of total x weight / sum, worked out here
    parts = share(total, weights)
    assert sum(parts) == total
    for p, w in zip(parts, weights, strict=True):
        assert abs(p - total * w / sum(weights)) < 1


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 50), min_size=1, max_size=30), st.lists(st.integers(1, 20), min_size=1, max_size=6))
def test_diffusion_keeps_leaves_exact_and_stacks_near_share(counts: list[int], weights: list[int]) -> None:
    # Oracle: arithmetic: every leaf's count kept, each stack within one of its share
    leaves = [(i, (), n) for i, n in enumerate(counts)]
    per_stack = [0] * len(weights)
    for _key, _gpu, n, parts in _diffuse(leaves, weights):  # type: ignore[arg-type]
        assert sum(parts) == n and min(parts) >= 0
        per_stack = [a + b for a, b in zip(per_stack, parts, strict=True)]
    total = sum(counts)
    for got, w in zip(per_stack, weights, strict=True):
        assert abs(got - total * w / sum(weights)) <= 1


def test_not_issued_samples_are_a_frame_under_their_reason(cubin90: GpuCode) -> None:
    # Oracle: CUPTI's documentation of `_not_issued`; counts by construction
    stalls = [RawStallSample("cupti", 7, 0, cubin90.digest, ADD, 0x40, LONG_SB, 3, correlation_id=42),
              RawStallSample("cupti", 7, 0, cubin90.digest, ADD, 0x40, LONG_SB, 7, correlation_id=42,
                             not_issued=True)]
    prof = stall_profile(_cap(stalls, [cubin90]), Profile(events=_launches()), sass=False)
    assert prof.total_weight == 10
    leaves = sorted((tuple(f.name for f in s.stack[-2:]), s.weight) for s in prof.samples)
    assert leaves == [(("+0x0040", "long_scoreboard"), 3), (("long_scoreboard", "not issued"), 7)]


def test_legacy_captures_count_not_issued_once(cubin90: GpuCode) -> None:
    """Captures written before the split hold `<reason>_not_issued` as a reason beside the reason's full count
    (as the H200's mlp capture did): read, it becomes the not-issued part of its reason."""
    # Oracle: CUPTI's documentation of `_not_issued`; counts by construction
    stalls = [RawStallSample("cupti", 7, 0, cubin90.digest, ADD, 0x40, LONG_SB, 10, correlation_id=42),
              RawStallSample("cupti", 7, 0, cubin90.digest, ADD, 0x40, LONG_SB + "_not_issued", 7,
                             correlation_id=42),
              RawStallSample("cupti", 7, 0, cubin90.digest, ADD, 0x50, WAIT + "_not_issued", 2, correlation_id=42)]
    prof = stall_profile(_cap(stalls, [cubin90]), Profile(events=_launches()), sass=False)
    assert prof.total_weight == 12 and prof.counters["stall_legacy_not_issued"] == 7
    leaves = sorted((tuple(f.name for f in s.stack[-2:]), s.weight) for s in prof.samples)
    assert leaves == [(("+0x0040", "long_scoreboard"), 3), (("+0x0050", "wait_not_issued"), 2),
                      (("long_scoreboard", "not issued"), 7)]


def test_real_h100_stream_symbolizes_every_sample() -> None:
    """The real stream (tests/data/cupti/README.md) through the stall view: every sample lands on a kernel of the
    cubin CUPTI handed over, at an instruction nvdisasm prints and a line of two_kernels.cu; not-issued samples
    sit under their reason; the total is CUPTI's own batch total."""
    # Oracle: nvdisasm -json of the cubin CUPTI handed over on an H100; CUPTI's own batch total
    from pathlib import Path

    from aiflame.symbolize.vendor.cupti_stream import parse_stream, stalls_from_stream

    path = Path(__file__).resolve().parent.parent / "data" / "cupti" / "h100-two_kernels.stream"
    s = parse_stream(path.read_bytes())
    samples, code, _ = stalls_from_stream(s)
    launches = [TraceEvent(k, EventKind.COMPUTE, 0, pid=s.pid, stack=_stack("main", f"launch_{k}", "cudaLaunchKernel"))
                for k in ("stream_axpy", "fma_chain")]
    prof = stall_profile(_cap(samples, code), Profile(events=launches))
    assert prof.total_weight == sum(b.total_samples for b in s.batches) == 12954
    raw = nvdisasm_sass(code[0].data)
    by_kernel: Counter[str] = Counter()
    for smp in prof.samples:
        names = [f.name for f in smp.stack]
        gpu = names[names.index("-") + 1:]
        assert names[1] == f"launch_{gpu[0]}"
        assert gpu[1].startswith("two_kernels.cu:") and int(gpu[1].split(":")[1]) > 0
        off, text = gpu[2].split(" ", 1)
        mangled = "_Z11stream_axpyPK6float4PS_fm" if gpu[0] == "stream_axpy" else "_Z9fma_chainPfi"
        assert squeeze(text) == raw[(mangled, int(off, 16))]  # nvdisasm's own reading
        assert len(gpu) == 4 or gpu[4] == "not issued"
        by_kernel[gpu[0]] += smp.weight
    assert set(by_kernel) == {"stream_axpy", "fma_chain"}
    assert sum(w for smp in prof.samples for w in [smp.weight] if smp.stack[-1].name == "not issued") == 2209

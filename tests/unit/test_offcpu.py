"""Off-CPU time (`profile --off-cpu`): records paired into weighted samples, the marker a blocked stack ends in,
the offcpu and wall views' weights, and what the capture, the CLI and the summary make of them."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from aiflame.agent.kernel.decode import OffCpuEnd, OffCpuStack, decode_record
from aiflame.agent.kernel.offcpu import OffCpuPairs
from aiflame.agent.kernel.records import OffCpuEndRec, RecKind, SampleRec
from aiflame.cli.main import main
from aiflame.cli.summary import off_cpu_line
from aiflame.core.capture import FORMAT_VERSION, OFF_CPU_FORMAT_VERSION, new_header, read_capture, write_capture
from aiflame.core.errors import NothingToShow
from aiflame.core.model import Frame, FrameKind, Profile, Sample
from aiflame.core.raw import Capture, CaptureFooter, CaptureHeader, Mapping, ProcessSnapshot, RawSample
from aiflame.exporters.folded import parse_folded
from aiflame.symbolize.offcpu import (
    CUDA_SYNC,
    NCCL,
    OFF_CPU,
    off_cpu_marker,
    offcpu_profile,
    wall_profile,
    with_marker,
)
from aiflame.symbolize.stacks import StackOptions, symbolize_capture

TRUE = shutil.which("true") or "/bin/true"


def _raw(tid: int, time_ns: int, off_cpu_ns: int = 0) -> RawSample:
    return RawSample(time_ns, 7, tid, 0, "t", (0x401000,), (), off_cpu_ns=off_cpu_ns)


# --- pairing ------------------------------------------------------------------------------------------------


def test_a_block_weighs_from_its_stack_to_its_end() -> None:
    # Oracle: by construction — a block from 1000 to 4000 ns built here
    pairs = OffCpuPairs()
    pairs.stack(_raw(11, 1000))
    pairs.stack(_raw(12, 1500))
    done = pairs.end(OffCpuEnd(7, 11, 1000, 4000))
    assert done is not None and (done.tid, done.time_ns, done.off_cpu_ns) == (11, 1000, 3000)
    assert len(pairs) == 1 and pairs.unpaired == 0


def test_threads_that_block_and_die_cannot_grow_the_pairs() -> None:
    """A hostile target whose threads block and exit (their block never ends): the oldest open blocks go, counted."""
    pairs = OffCpuPairs(limit=100)
    for tid in range(1000, 1500):
        pairs.stack(_raw(tid, tid))
    assert len(pairs) == 100 and pairs.unpaired == 400
    done = pairs.end(OffCpuEnd(7, 1499, 1499, 2000))  # the newest are kept
    assert done is not None and done.off_cpu_ns == 501
    assert pairs.end(OffCpuEnd(7, 1000, 1000, 2000)) is None and pairs.unpaired == 401


def test_lost_records_are_counted_not_guessed() -> None:
    # Oracle: by construction — records dropped here on purpose
    pairs = OffCpuPairs()
    assert pairs.end(OffCpuEnd(7, 11, 1000, 4000)) is None  # its stack was lost
    pairs.stack(_raw(11, 5000))
    pairs.stack(_raw(11, 9000))  # the end of the block at 5000 was lost
    assert pairs.end(OffCpuEnd(7, 11, 5000, 6000)) is None  # an end of the superseded block: not this stack's
    done = pairs.end(OffCpuEnd(7, 11, 9000, 9500))
    assert done is not None and done.off_cpu_ns == 500
    assert pairs.unpaired == 3


def test_threads_still_blocked_at_the_end_are_blocked_until_then() -> None:
    # Oracle: by construction — blocks open since 1000 and 2000 ns at 10,000 ns
    pairs = OffCpuPairs()
    pairs.stack(_raw(11, 1000))
    pairs.stack(_raw(12, 2000))
    assert sorted((s.tid, s.off_cpu_ns) for s in pairs.finish(10_000)) == [(11, 9000), (12, 8000)]
    assert len(pairs) == 0


def test_records_decode() -> None:
    # Oracle: by construction — records laid out here by the ctypes structs of bpf/aiflame.h
    rec = SampleRec(kind=RecKind.OFFCPU, cpu=1, time_ns=123, pid=10, tid=11, user_len=16, kern_len=8, comm=b"w")
    rec.data[0], rec.data[1], rec.data[2] = 0x401000, 0x401100, 0xFFFF1
    out = decode_record(bytes(rec)[:SampleRec.data.offset + 24])
    assert isinstance(out, OffCpuStack)
    assert (out.sample.time_ns, out.sample.user, out.sample.kern, out.sample.off_cpu_ns) == \
        (123, (0x401000, 0x401100), (0xFFFF1,), 0)
    end = OffCpuEndRec(kind=RecKind.OFFCPU_END, cpu=0, time_ns=900, pid=10, tid=11, out_ns=123)
    assert decode_record(bytes(end)) == OffCpuEnd(10, 11, 123, 900)


# --- what a blocked stack waited on -------------------------------------------------------------------------


def _frames(*names: str) -> tuple[Frame, ...]:
    return tuple(Frame(n) for n in names)


@pytest.mark.parametrize(("names", "marker"), [
    (("main", "sleep", "clock_nanosleep"), OFF_CPU),
    (("main", "step", "cudaStreamSynchronize", "libcuda.so+0x1234", "ioctl"), CUDA_SYNC),
    (("main", "cudaDeviceSynchronize", "cuCtxSynchronize", "futex_wait"), CUDA_SYNC),
    (("main", "cuStreamSynchronize_ptsz", "poll"), CUDA_SYNC),
    (("train", "ncclAllReduce", "ncclGroupEnd", "pthread_cond_wait"), NCCL),
    (("train", "ncclGroupEnd", "cudaStreamSynchronize", "ioctl"), NCCL),  # the call the program made names it
    (("main", "cudaStreamSynchronizeHelper"), OFF_CPU),
    (("main", "nccl_helper", "ncclx"), OFF_CPU),
])
def test_the_rootward_runtime_frame_names_the_block(names: tuple[str, ...], marker: Frame) -> None:
    # Oracle: by construction — stacks through each runtime's blocking call
    assert off_cpu_marker(_frames(*names)) is marker


def test_nccl_by_module_and_kernel_frames_never_name_it() -> None:
    # Oracle: by construction — a frame in libnccl.so.2, and a kernel frame named like NCCL
    assert off_cpu_marker((Frame("main"), Frame("proxy", module="libnccl.so.2"))) is NCCL
    assert off_cpu_marker((Frame("main"), Frame("ncclFake", FrameKind.KERNEL))) is OFF_CPU


def test_a_python_only_stack_takes_the_marker_of_its_native_frames() -> None:
    # Oracle: by construction — a stack through cudaDeviceSynchronize
    py = (Frame("train", FrameKind.PYTHON), Frame("synchronize", FrameKind.PYTHON))
    native = _frames("PyEval_EvalFrameDefault", "cudaDeviceSynchronize", "ioctl")
    assert with_marker(py, native) == (*py, CUDA_SYNC)
    assert with_marker(py, ()) == (*py, OFF_CPU)


# --- views --------------------------------------------------------------------------------------------------


def _prof(hz: int = 100) -> Profile:
    compute = (Frame("main"), Frame("compute"))
    wait = (Frame("main"), Frame("wait"), OFF_CPU)
    return Profile(samples=[Sample(compute, 1), Sample(compute, 2)], meta={"frequency_hz": str(hz)},
                   off_cpu=[Sample(wait, 20_000_000), Sample(wait, 10_000_000)])


def test_wall_weighs_cpu_samples_by_the_period_and_blocks_by_their_time() -> None:
    # Oracle: by construction — 3 samples at 100 Hz and 30 ms blocked
    wall = wall_profile(_prof(hz=100))  # 3 samples at 100 Hz: 30 ms on CPU; 30 ms blocked
    assert wall.unit == "ns" and wall.total_weight == 60_000_000
    by_leaf = {stack[-1].name: w for stack, w in wall.aggregate().items()}
    assert by_leaf == {"compute": 30_000_000, "[off-cpu]": 30_000_000}
    off = offcpu_profile(_prof())
    assert off.unit == "ns" and off.total_weight == 30_000_000
    assert all(s.stack[-1].kind == FrameKind.OFF_CPU for s in off.samples)


def test_off_cpu_views_of_a_capture_without_them_are_refused() -> None:
    prof = _prof()
    prof.off_cpu = []
    for view in (wall_profile, offcpu_profile):
        with pytest.raises(NothingToShow, match="profile --off-cpu"):
            view(prof)


def test_summary_line_names_the_time_in_each_runtime() -> None:
    # Oracle: by construction — 30 ms and 1.5 s of blocks put in here
    prof = _prof()
    prof.off_cpu.append(Sample((Frame("main"), NCCL), 1_500_000_000))
    assert off_cpu_line(prof) == "off-CPU: 1.53 s blocked in 3 blocks (nccl 1.50 s)"
    assert off_cpu_line(Profile()) == ""


def test_folded_marker_reads_back_as_off_cpu() -> None:
    prof = parse_folded("main;wait;[off-cpu: cuda sync] 5\n")
    assert prof.samples[0].stack[-1] == Frame("[off-cpu: cuda sync]", FrameKind.OFF_CPU)


# --- capture and symbolization ------------------------------------------------------------------------------


def _capture() -> Capture:
    cap = Capture(CaptureHeader(OFF_CPU_FORMAT_VERSION, target="test", frequency_hz=100))
    cap.processes = [ProcessSnapshot(7, 1, [Mapping(0x400000, 0x410000, 0, TRUE)], comm="t")]
    cap.kernel_symbols = {0xFFFF0001: "schedule"}
    cap.samples = [_raw(7, 5), _raw(7, 6, off_cpu_ns=25_000_000)]
    cap.samples[1].kern = (0xFFFF0001,)
    cap.footer = CaptureFooter()
    return cap


def test_off_cpu_samples_are_apart_from_cpu_samples_and_end_in_their_marker() -> None:
    # Oracle: by construction — one CPU sample and one 25 ms block in the capture built here
    prof = symbolize_capture(_capture(), options=StackOptions(group="none"))
    assert [s.weight for s in prof.samples] == [1]
    (blocked,) = prof.off_cpu
    assert blocked.weight == 25_000_000
    assert [f.kind for f in blocked.stack[-2:]] == [FrameKind.KERNEL, FrameKind.OFF_CPU]
    assert blocked.stack[-1] is OFF_CPU and blocked.stack[:-2] == prof.samples[0].stack


def test_capture_format_says_it_holds_off_cpu_samples(tmp_path: Path) -> None:
    assert new_header(99, "cpu-clock", [], "t").format_version == FORMAT_VERSION
    assert new_header(99, "cpu-clock", [], "t", off_cpu=True).format_version == OFF_CPU_FORMAT_VERSION == 2
    write_capture(tmp_path / "c.aiflame", _capture())
    back = read_capture(tmp_path / "c.aiflame")
    assert [s.off_cpu_ns for s in back.samples] == [0, 25_000_000]


# --- command line -------------------------------------------------------------------------------------------


def test_off_cpu_with_the_whole_host_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["profile", "-a", "--off-cpu"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("aiflame: error: --off-cpu records where the targets' threads block") and \
        err.count("\n") == 1


def test_wall_view_of_a_capture_without_off_cpu_is_one_line(tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    cap = _capture()
    cap.samples = cap.samples[:1]
    write_capture(tmp_path / "c.aiflame", cap)
    assert main(["export", str(tmp_path / "c.aiflame"), "--view", "wall", "-f", "folded", "-o",
                 str(tmp_path / "w.folded")]) == 1
    err = capsys.readouterr().err
    assert "no off-CPU samples in this capture" in err and err.count("\n") == 1


def test_export_wall_view(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Oracle: by construction — one sample at 100 Hz (10 ms) and a 25 ms block
    write_capture(tmp_path / "c.aiflame", _capture())
    assert main(["export", str(tmp_path / "c.aiflame"), "--view", "wall", "-f", "folded", "--group", "none",
                 "-o", str(tmp_path / "w.folded")]) == 0
    assert "w.folded (0.035 s)" in capsys.readouterr().out
    lines = (tmp_path / "w.folded").read_text().splitlines()
    assert len(lines) == 2
    counts = sorted(int(line.rpartition(" ")[2]) for line in lines)
    assert counts == [10_000_000, 25_000_000]  # one sample at 100 Hz; the block
    assert any(line.split(" ")[0].endswith("schedule_[k];[off-cpu]") for line in lines)

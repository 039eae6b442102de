"""The AI flame graph end to end on a real probed run: a CUDA program built with nvcc is profiled (launch
stacks from real uprobes, cubins stored in the capture), stall samples are constructed at real instruction
offsets of its kernels and imported, and the folded, SVG and pprof outputs are read back line by line."""

from __future__ import annotations

import io
import re
import struct
from collections import Counter
from pathlib import Path

import pytest
from rich.console import Console

from aiflame.cli.summary import print_summary
from aiflame.core.capture import read_capture, write_capture
from aiflame.core.raw import RawStallSample
from aiflame.exporters import get_exporter
from aiflame.symbolize import views
from aiflame.symbolize.accel.cubin import parse_cubin
from aiflame.symbolize.stacks import StackOptions, symbolize_capture
from aiflame.symbolize.vendor.stall_import import import_records
from tests.cuda_build import KernelPrograms, kernel_programs
from tests.integration.conftest import aiflame, read_folded
from tests.nvdisasm_read import nvdisasm_lines, nvdisasm_sass, squeeze
from tests.pprof_read import read_pprof

SCALE = "_Z5scalePffi"
ADD = "_Z3addPKfS0_Pfi"
REASONS = ["smsp__pcsamp_warps_issue_stalled_long_scoreboard", "smsp__pcsamp_warps_issue_stalled_math_pipe_throttle",
           "smsp__pcsamp_warps_issue_stalled_wait"]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, KernelPrograms]:
    progs = kernel_programs(tmp_path_factory)
    out = tmp_path_factory.mktemp("stallrun")
    aiflame("profile", "-o", str(out), "-q", "--formats", "folded", "--", str(progs.plain))
    return out / "profile.aiflame", progs


@pytest.fixture(autouse=True)
def _cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIFLAME_CACHE", str(tmp_path_factory.getbasetemp() / "stall-int-cache"))


def _with_stalls(capture: Path, dest: Path) -> tuple[Path, list[RawStallSample], dict[tuple[str, int], str]]:
    """A copy of the capture plus CUPTI-like stall samples at every 3rd instruction of scale and add (sm_90), and
    that cubin's SASS as nvdisasm -json gives it (the oracle)."""
    cap = read_capture(capture)
    pid = next(e.pid for e in cap.events if e.kind == "compute")
    code = next(g for g in cap.gpu_code if g.kind == "cubin" and g.arch == 90)
    cubin = parse_cubin(code.data)
    stalls = []
    for kernel, weight in ((SCALE, 3), (ADD, 1)):
        for i, off in enumerate(range(0, cubin.kernels[kernel].size, 48)):
            n = weight * (i % 4 + 1)
            stalls.append(RawStallSample("cupti", pid, 0, code.digest, kernel, off, REASONS[i % 3], n))
    cap.stalls = stalls
    write_capture(dest, cap)
    return dest, stalls, nvdisasm_sass(code.data)


def test_ai_flame_graph_folded_layout(run: tuple[Path, KernelPrograms], tmp_path: Path) -> None:
    # Oracle: nvdisasm -json (SASS), nvdisasm -g (lines); stall counts by construction
    path, stalls, sass = _with_stalls(run[0], tmp_path / "s.aiflame")
    cap = read_capture(path)
    prof = symbolize_capture(cap, options=StackOptions(group="none"))
    view = views.view(cap, prof, "stalls")
    assert view.total_weight == sum(s.count for s in stalls)
    assert view.counters.get("stall_unknown_launch", 0) == 0 and view.counters.get("stall_no_source", 0) == 0
    text = get_exporter("folded").render(view).decode()
    lines = text.splitlines()
    assert lines, text
    src_lines = nvdisasm_lines(next(g for g in cap.gpu_code if g.digest == stalls[0].code).data)
    per_kernel: Counter[str] = Counter()
    for line in lines:
        stack, count = line.rsplit(" ", 1)
        frames = stack.split(";")
        sep = frames.index("-")
        cpu, gpu = frames[:sep], frames[sep + 1:]
        # CPU part: the real launch stack from the uprobes, main -> run_steps -> launch_<kernel>
        helper = "launch_scale" if gpu[0] == "scale_[G]" else "launch_add"
        assert cpu.index("main") < cpu.index("run_steps") < cpu.index(helper), cpu
        assert not any(f.endswith(("_[G]", "_[g]")) for f in cpu)
        # GPU part: kernel, file:line, +offset instruction, stall reason
        assert len(gpu) == 4 and gpu[0] in ("scale_[G]", "add_[G]")
        mangled = SCALE if gpu[0] == "scale_[G]" else ADD
        m = re.fullmatch(r"kernels\.cu:(\d+)_\[G\]", gpu[1])
        assert m, gpu[1]
        m2 = re.fullmatch(r"\+(0x[0-9a-f]{4,}) (.+)_\[g\]", gpu[2])
        assert m2, gpu[2]
        off = int(m2.group(1), 16)
        assert int(m.group(1)) == (src_lines[mangled][off] or ("", -1))[1]  # nvdisasm -g's line
        assert squeeze(m2.group(2)) == sass[(mangled, off)]  # nvdisasm -json's text
        assert gpu[3] in ("long_scoreboard_[g]", "math_pipe_throttle_[g]", "wait_[g]")
        per_kernel[gpu[0]] += int(count)
    want = Counter[str]()
    for s in stalls:
        want["scale_[G]" if s.kernel == SCALE else "add_[G]"] += s.count
    assert per_kernel == want
    java = get_exporter("folded", palette="java").render(view).decode()
    assert "_[G]" not in java and "_[g]" not in java and "scale_[i]" in java and "wait_[j]" in java
    assert java.count("\n") == len(lines)


def test_outputs_svg_pprof_and_summary(run: tuple[Path, KernelPrograms], tmp_path: Path) -> None:
    # Oracle: Google's profile.proto (tests/pprof_read.py); stall counts by construction
    path, stalls, _ = _with_stalls(run[0], tmp_path / "s.aiflame")
    cap = read_capture(path)
    prof = symbolize_capture(cap)
    view = views.view(cap, prof, "stalls", sass=False)
    svg = get_exporter("svg", title="AI flame graph").render(view).decode()
    kinds = Counter(re.findall(r'data-kind="(\w+)"', svg))
    assert kinds["accel_source"] > 0 and kinds["accel_instr"] > 0 and kinds["stall"] > 0 and kinds["separator"] > 0
    # Palette: green instructions and reasons, aqua kernels/source, grey '-'.
    def green(r: int, g: int, b: int) -> bool:
        return g > r and g > b

    def aqua(r: int, g: int, b: int) -> bool:
        return g > r and b > r

    def grey(r: int, g: int, b: int) -> bool:
        return r == g == b

    for kind, test in (("accel_instr", green), ("stall", green), ("accel_source", aqua), ("separator", grey)):
        for r, g, b in re.findall(rf'data-kind="{kind}"[^>]*>.*?fill="rgb\((\d+),(\d+),(\d+)\)"', svg):
            assert test(int(r), int(g), int(b)), (kind, r, g, b)
    p = read_pprof(get_exporter("pprof").render(view))  # Google's profile.proto and pprof's validity rules
    st = list(p.string_table)
    assert st[0] == "" and st[p.sample_type[0].type] == "stall_samples"
    assert sum(s.value[0] for s in p.sample) == sum(s.count for s in stalls)
    funcs = {f.id: st[f.name] for f in p.function}
    locs = {loc.id: funcs[loc.line[0].function_id] for loc in p.location}
    reasons = Counter[str]()
    for s in p.sample:
        strs = {st[lab.key]: st[lab.str] for lab in s.label if lab.str}
        nums = {st[lab.key]: lab.num for lab in s.label if not lab.str}
        leaf = locs[s.location_id[0]]
        assert strs["stall_reason"] == leaf and strs["kernel"] in ("scale", "add") and nums["pid"] > 0
        reasons[leaf] += s.value[0]
    assert set(reasons) == {"long_scoreboard", "math_pipe_throttle", "wait"}
    buf = io.StringIO()
    print_summary(Console(file=buf, width=200), prof, stalls=view)
    out = buf.getvalue()
    assert "Kernels by stall samples" in out and "scale" in out and "long_scoreboard" in out
    assert "kernels.cu:" in out


def test_import_rocprof_and_xe_into_a_real_capture(run: tuple[Path, KernelPrograms], tmp_path: Path) -> None:
    # Oracle: by construction — 4 rocprof and 5 Xe records built here
    from tests.unit.test_rocprof_pc import stochastic
    from tests.unit.test_xe_eu_stall import record

    capture = run[0]
    (tmp_path / "pc.bin").write_bytes(stochastic(7, 0x40, 3) * 4)
    res = import_records(capture, [tmp_path / "pc.bin"], "rocprof", output=tmp_path / "a.aiflame", pid=123)
    assert res.stall_samples == 4 and res.counters["rocprof_unknown_kernel"] == 4
    (tmp_path / "x.bin").write_bytes(record("pvc", 0x20, {"sbid": 5}) + bytes(64))
    import_records(tmp_path / "a.aiflame", [tmp_path / "x.bin"], "xe", output=tmp_path / "a.aiflame",
                   platform="pvc")
    cap = read_capture(tmp_path / "a.aiflame")
    assert sorted((s.source, s.count) for s in cap.stalls) == [("rocprof", 4), ("xe", 5)]
    assert cap.footer is not None and cap.footer.counters["xe_empty_records"] == 1
    assert cap.footer.counters["imported_stall_samples"] == 9
    assert len(cap.samples) == len(read_capture(capture).samples)
    view = views.view(cap, symbolize_capture(cap), "stalls", sass=False)
    assert view.total_weight == 9 and view.counters["stall_unknown_launch"] == 9
    assert view.counters["rocprof_unknown_kernel"] == 4 and view.counters["xe_empty_records"] == 1
    proc = aiflame("import", str(tmp_path / "a.aiflame"), str(tmp_path / "x.bin"), "--format", "xe", check=False)
    assert proc.returncode != 0 and "--platform" in proc.stderr  # the layout must be named
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_cli_stall_view_diff_and_import(run: tuple[Path, KernelPrograms], tmp_path: Path) -> None:
    """The wired commands, as a user runs them: export --view stalls, render --diff, import."""
    # Oracle: flamegraph.pl's reading of the folded files (read_folded); counts by construction
    path, stalls, _ = _with_stalls(run[0], tmp_path / "s.aiflame")
    aiflame("export", str(path), "--format", "folded", "--view", "stalls", "--group", "none",
            "-o", str(tmp_path / "stalls.folded"))
    folded = read_folded(tmp_path / "stalls.folded")
    assert sum(folded.values()) == sum(s.count for s in stalls)
    assert all(";-;" in k and k.split(";")[-1].endswith("_[g]") for k in folded)
    combined = tmp_path / "combined.folded"
    aiflame("export", str(path), "--format", "folded", "--view", "combined", "-o", str(combined))
    assert sum(read_folded(combined).values()) == sum(s.count for s in stalls) + len(read_capture(path).samples)
    # the same capture without stall samples: a one-line error for the stall view
    proc = aiflame("export", str(run[0]), "--format", "folded", "--view", "stalls", "-o", str(tmp_path / "x"),
                   check=False)
    assert proc.returncode == 1 and "no accelerator stall samples" in proc.stderr and "Traceback" not in proc.stderr
    # differential: before = the stall view, after = a copy with twice the scale kernel's samples
    after_lines = [f"{k} {v * 2 if ';scale_[G];' in k else v}" for k, v in folded.items()]
    (tmp_path / "after.folded").write_text("\n".join(after_lines) + "\n")
    aiflame("render", "--diff", str(tmp_path / "stalls.folded"), str(tmp_path / "after.folded"),
            "-o", str(tmp_path / "diff.svg"))
    svg = (tmp_path / "diff.svg").read_text()
    assert "scale_[G]" in svg and "add_[G]" in svg
    proc = aiflame("render", "-o", str(tmp_path / "y.svg"), check=False)
    assert proc.returncode == 2 and "--diff" in proc.stderr
    aiflame("import", str(path), str(path), "--format", "capture", "-o", str(tmp_path / "merged.aiflame"))
    assert len(read_capture(tmp_path / "merged.aiflame").stalls) == 2 * len(stalls)


def test_import_cupti_stream_into_a_real_capture(run: tuple[Path, KernelPrograms], tmp_path: Path) -> None:
    """A CUPTI stream as the injection library writes it on a GPU host, imported offline: its samples land on
    the real kernels' instructions under their launch stacks, and its cubin, already in the capture, is not
    stored twice. A stream cut short is imported up to its last record and counted."""
    # Oracle: by construction — a stream written here at the real kernels' offsets
    from aiflame.symbolize.vendor.cupti_stream import RecordType
    from tests.unit.test_cupti_stream import _header, _pcs, _rec, _str

    capture = run[0]
    cap = read_capture(capture)
    pid = next(e.pid for e in cap.events if e.kind == "compute")
    code = next(g for g in cap.gpu_code if g.kind == "cubin" and g.arch == 90)
    table = struct.pack("<II", 1, len(REASONS)) + b"".join(struct.pack("<I", i) + _str(r)
                                                          for i, r in enumerate(REASONS))
    stream = (_header(pid) + _rec(RecordType.CONTEXT, struct.pack("<IIQ", 1, 0, 9))
              + _rec(RecordType.REASONS, table)
              + _rec(RecordType.CUBIN, struct.pack("<IIQQ", 1, 2, 7, len(code.data)) + code.data)
              + _rec(RecordType.PCS, _pcs(1, [(7, 0x40, SCALE, [(0, 5), (2, 1)]), (7, 0x80, ADD, [(1, 3)])]))
              + _rec(RecordType.END, b""))
    (tmp_path / "p.cupti").write_bytes(stream)
    aiflame("import", str(capture), str(tmp_path / "p.cupti"), "--format", "cupti", "-o", str(tmp_path / "c.aiflame"))
    merged = read_capture(tmp_path / "c.aiflame")
    assert sorted((s.kernel, s.offset, s.reason, s.count, s.pid, s.code) for s in merged.stalls) == [
        (ADD, 0x80, REASONS[1], 3, pid, code.digest), (SCALE, 0x40, REASONS[0], 5, pid, code.digest),
        (SCALE, 0x40, REASONS[2], 1, pid, code.digest)]
    assert len(merged.gpu_code) == len(cap.gpu_code) and len(merged.samples) == len(cap.samples)
    assert merged.footer is not None and merged.footer.counters["imported_stall_samples"] == 9
    assert merged.footer.counters["cupti_samples"] == 9 and "cupti_stream_problems" not in merged.footer.counters
    view = views.view(merged, symbolize_capture(merged, options=StackOptions(group="none")), "stalls", sass=False)
    assert view.total_weight == 9 and not view.counters.get("stall_unknown_launch")
    per_kernel: Counter[str] = Counter()
    for sample in view.samples:
        names = [f.name for f in sample.stack]
        sep = names.index("-")
        assert "run_steps" in names[:sep] and re.fullmatch(r"kernels\.cu:\d+", names[sep + 2]), names
        per_kernel[names[sep + 1]] += sample.weight
    assert per_kernel == {"scale": 6, "add": 3}
    (tmp_path / "cut.cupti").write_bytes(stream[:-8])  # no END record: the process was killed
    res = import_records(capture, [tmp_path / "cut.cupti"], "cupti", output=tmp_path / "d.aiflame")
    assert res.stall_samples == 9 and res.counters["cupti_stream_problems"] == 1

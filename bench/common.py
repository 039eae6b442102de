"""Helpers shared by the benchmarks: paths, process control, BPF program stats from fdinfo."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples" / "bin"
RESULTS = REPO / "bench" / "results"
PERF_EVENT_PROG = 7  # BPF_PROG_TYPE_PERF_EVENT
# `aiflame profile` arguments of the modes the benches of issue #25 compare
PROFILE_MODES: dict[str, list[str]] = {
    "cpu": ["--no-runtimes", "--no-gpu-samples"],  # CPU sampling only
    "probes": ["--no-gpu-samples"],  # CPU sampling and the runtime probes (no CUPTI)
    # each call's return probed on its own, as before uprobe session links (kernel 6.13)
    "probes_separate": ["--no-gpu-samples", "--separate-return-probes"],
    # the daemon's defaults (agent/daemon/config.py ContinuousConfig, sampling cpu-clock)
    "daemon": ["--no-gpu-samples", "-F", "19", "--event", "cpu-clock", "--launch-stacks", "20"],
}


def rss_mb(pid: int) -> float:
    """Resident memory of `pid` in MB."""
    return psutil.Process(pid).memory_info().rss / (1 << 20)


def vm_hwm_kb(pid: int) -> int:
    """Peak resident set (VmHWM) of `pid` in KiB; 0 when it cannot be read (the process is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def aiflame_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "aiflame", *args]


def bpf_prog_stats(pid: int, prog_type: int = PERF_EVENT_PROG) -> tuple[int, int]:
    """Sum of (run_time_ns, run_cnt) over BPF programs of `prog_type` held open by `pid`."""
    total_ns = total_cnt = 0
    fd_dir = Path(f"/proc/{pid}/fdinfo")
    for fd in fd_dir.iterdir():
        try:
            text = fd.read_text()
        except OSError:
            continue
        m = re.search(r"^prog_type:\s+(\d+)", text, re.M)
        if not m or int(m.group(1)) != prog_type:
            continue
        ns = re.search(r"^run_time_ns:\s+(\d+)", text, re.M)
        cnt = re.search(r"^run_cnt:\s+(\d+)", text, re.M)
        if ns and cnt:
            total_ns += int(ns.group(1))
            total_cnt += int(cnt.group(1))
    return total_ns, total_cnt


def holds_perf_prog(pid: int) -> bool:
    """True once `pid` holds a perf-event BPF program (the profiler has compiled and attached)."""
    try:
        return any(f"prog_type:\t{PERF_EVENT_PROG}\n" in p.read_text() for p in Path(f"/proc/{pid}/fdinfo").iterdir())
    except OSError:
        return False


def capture_figures(path: Path) -> dict[str, float]:
    """Agent CPU (% of a core over the capture), sample and loss counts from an aiflame capture."""
    from aiflame.core.capture import read_capture

    cap = read_capture(path)
    assert cap.footer is not None
    elapsed = (cap.footer.end_mono_ns - cap.header.start_mono_ns) / 1e9
    return {
        "agent_cpu_pct": 100 * cap.footer.agent_cpu_s / elapsed,
        "samples": len(cap.samples),
        "py_samples": sum(1 for s in cap.samples if s.py),
        "lost": cap.footer.counters.get("lost", 0),
    }


def set_bpf_stats(on: bool) -> None:
    Path("/proc/sys/kernel/bpf_stats_enabled").write_text("1" if on else "0")


def wait_for(pred: object, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if callable(pred) and pred():
            return True
        time.sleep(0.05)
    return False


def save(name: str, data: Mapping[str, object]) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(data, indent=2) + "\n")
    return path


def conditions() -> dict[str, object]:
    return {
        "kernel": os.uname().release,
        "cpus": os.cpu_count(),
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "python": sys.version.split()[0],
    }


def run_quiet(cmd: list[str], **kw: object) -> subprocess.Popen[str]:
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO, **kw)  # type: ignore[call-overload, no-any-return]

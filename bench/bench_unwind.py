"""The CFI unwinder's figures (#17), against perf's DWARF unwinding and against the frame-pointer walk.

    python bench/bench_unwind.py [--loss-s 60] [--cost-s 20] [--no-save]

1. oracle: `tests/unwind_oracle.py` (both profilers on the same processes): the share of samples with libtorch
   C++ frames (at::, c10::) under their Python caller on the dispatcher loop, vs perf's share of samples with
   them at all; the share of C samples reaching main on unwind_work.c at -O1 -fomit-frame-pointer.
2. tables: libtorch_cpu.so's table built in a fresh process, cold and warm (bench_cfi.py's children), its rows
   in the BPF pool (8 B each) and rules (12 B each).
3. capture: `aiflame profile` of the dispatcher loop with an empty cache, then warm: the agent's peak RSS
   (VmHWM, polled), the time from the command's exit (its last sample) to the capture closed and to the files
   written.
4. cost: in-kernel time per sample (kernel.bpf_stats_enabled: run_time_ns of on_sample + uw_sample_step +
   sample_finish over the window, per sample delivered), CFI and frame pointers only (SamplerConfig(cfi=False))
   attached to the same target at the same time, so host noise hits both alike; on the -O1 C program and on the
   dispatcher loop.
5. loss: lost samples at 999 Hz with every CPU busy in no-FP code (one unwind_work-O1 per CPU).
Results go to bench/results/unwind.json unless --no-save.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from common import REPO, aiflame_cmd, conditions, save, set_bpf_stats, vm_hwm_kb

sys.path.insert(0, str(REPO))
from tests.unwind_oracle import (  # noqa: E402
    TORCH_WORK,
    build_c_workload,
    cpp_under_python,
    run_oracle,
    share,
)

COST_PROGS = ("on_sample", "uw_sample_step", "sample_finish")
COST_HZ = 499
# The frame-pointer session samples at a slightly different rate: at one rate the two sessions' timers keep one
# phase for a whole run, so one session's program always runs just after the other's (finding the stack, the
# Python frames and the helpers' code warm in cache) or long after, and the ratio moved by ±0.1 from run to run.
# 499 and 487 Hz slide through every phase ~50 times a second.
COST_HZ_OTHER = 487
COST_WARMUP_S = 3.0


def _aiflame(*args: str, timeout: float = 600) -> None:
    subprocess.run(aiflame_cmd(*args), cwd=REPO, check=True, timeout=timeout, stdout=subprocess.DEVNULL)


def oracle_figures(tmp: Path) -> dict[str, object]:
    exe = build_c_workload(tmp / "c", "-O1")
    runs = run_oracle([("c-O1", [exe, "5"]), ("torch", [sys.executable, TORCH_WORK, "4"])], tmp / "oracle", _aiflame)
    c, torch = runs["c-O1"], runs["torch"]

    def reached_main(frames: list[str]) -> bool:
        return "main" in frames or (bool(frames) and frames[0] == "_start")

    perf_cpp = share([list(p.frames) for p in torch.perf], lambda s: any(f.startswith(("at::", "c10::")) for f in s))
    ours_cpp = share(torch.ours.stacks, cpp_under_python)
    return {
        "c_O1_samples": [len(c.ours.stacks), len(c.perf)],
        "c_O1_reach_main": share(c.ours.names(), reached_main),
        "c_O1_reach_main_perf": share([list(p.frames) for p in c.perf], reached_main),
        "torch_samples": [len(torch.ours.stacks), len(torch.perf)],
        "torch_cpp_under_python": ours_cpp,
        "torch_cpp_perf": perf_cpp,
        "torch_cpp_ratio": ours_cpp / perf_cpp if perf_cpp else 0.0,
        "torch_python_spliced": torch.ours.counters.get("python_spliced", 0),
        "torch_unwind_counters": {k: v for k, v in torch.ours.counters.items() if k.startswith("unwind_")},
    }


def _libtorch() -> str:
    import torch

    return str(Path(torch.__file__).parent / "lib" / "libtorch_cpu.so")


def table_figures(tmp: Path) -> dict[str, object]:
    import bench_cfi

    lib = os.path.realpath(_libtorch())
    engine = tmp / "engine"
    compiled = bench_cfi.run_child("compile", "", str(engine))
    cache = tmp / "tables"
    (cache / "cfi").mkdir(parents=True)
    for name in os.listdir(engine / "cfi"):
        os.link(engine / "cfi" / name, cache / "cfi" / name)
    cold = bench_cfi.run_child("cold", lib, str(cache))
    warm = bench_cfi.run_child("warm", lib, str(cache))
    stats = cold["stats"]
    assert isinstance(stats, dict)
    rows, rules = int(stats["rows"]), int(stats["rules"])
    header = (REPO / "bpf" / "unwind.h").read_text()
    m = re.search(r"#define AIFLAME_UNWIND_ROWS \(1 << (\d+)\)", header)
    pool_rows = 1 << int(m.group(1)) if m else 0
    from aiflame.agent.kernel.unwind import page_index
    from aiflame.symbolize.objfmt.cfi import load_or_build

    paged = page_index(load_or_build(lib, str(cache / "cfi")).rows)  # the table just built
    index_entries = len(paged[2]) if paged else 0
    return {
        "binary": lib,
        "engine_compile_s": compiled["s"],
        "fdes": stats["fdes"],
        "rows": rows,
        "rules": rules,
        "cold_s": cold["s"], "cold_cpu_s": cold["cpu_s"], "cold_rss_mb": cold["rss_mb"],
        "warm_s": warm["s"], "warm_cpu_s": warm["cpu_s"], "warm_rss_mb": warm["rss_mb"],
        "bpf_rows_mib": rows * 8 / 2**20,
        "bpf_rules_kib": rules * 12 / 2**10,
        "bpf_index_kib": index_entries * 4 / 2**10,
        "bpf_total_mib": (rows * 8 + rules * 12 + index_entries * 4) / 2**20,
        "pool_rows": pool_rows,
        "pool_mib": pool_rows * 8 / 2**20,
    }


def _cpu_s(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return -1.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime of the process itself


def capture_run(out: Path, cache: Path, *extra: str) -> dict[str, float]:
    """`aiflame profile -F 499 -- python unwind_torch.py 3`: the agent's peak RSS (VmHWM, polled) and its
    post-capture times: from the workload's last sample (its exit) to the capture closed (footer) and to the
    aiflame process's exit (files written), and the agent's own CPU time over the latter (polled)."""
    from aiflame.core.capture import read_capture

    env = {**os.environ, "AIFLAME_CACHE": str(cache)}
    proc = subprocess.Popen(aiflame_cmd("profile", "-q", "-F", "499", *extra, "-o", str(out), "--", sys.executable,
                                        str(TORCH_WORK), "3"), cwd=REPO, env=env, stdout=subprocess.DEVNULL)
    hwm, polls = 0, []
    while proc.poll() is None:
        hwm = max(hwm, vm_hwm_kb(proc.pid))
        cpu = _cpu_s(proc.pid)
        if cpu >= 0:
            polls.append((time.monotonic_ns(), cpu))
        time.sleep(0.05)
    done_ns = time.monotonic_ns()
    if proc.returncode:
        raise SystemExit(f"aiflame profile failed ({proc.returncode})")
    cap = read_capture(out / "profile.aiflame")
    assert cap.footer is not None
    workload = {s.pid for s in cap.samples if "python" in s.comm}
    exit_ns = max(s.time_ns for s in cap.samples if s.pid in workload)
    cpu_at_exit = next((c for t, c in polls if t >= exit_ns), polls[-1][1])
    return {
        "agent_peak_rss_mb": hwm / 1024,
        "exit_to_capture_closed_s": (cap.footer.end_mono_ns - exit_ns) / 1e9,
        "exit_to_files_written_s": (done_ns - exit_ns) / 1e9,
        "agent_cpu_after_exit_s": polls[-1][1] - cpu_at_exit,  # up to the last poll, <= 50 ms before its end
        "samples": len(cap.samples),
        "agent_cpu_capture_s": cap.footer.agent_cpu_s,
    }


def capture_figures(tmp: Path, cache: Path) -> dict[str, object]:
    cold = capture_run(tmp / "cold", cache)
    warm = capture_run(tmp / "warm", cache)
    # without runtime probes: no uprobes to detach at the end (each waits out the kernel's grace period)
    warm_no_probes = capture_run(tmp / "warm-no-runtimes", cache, "--no-runtimes")
    return {"cold": cold, "warm": warm, "warm_no_runtimes": warm_no_probes}


def _prog_stats(progs: dict[str, int]) -> dict[str, tuple[int, int]]:
    """(run_time_ns, run_cnt) of each named program fd of this process."""
    out = {}
    for name, fd in progs.items():
        text = Path(f"/proc/self/fdinfo/{fd}").read_text()
        ns = re.search(r"^run_time_ns:\s+(\d+)", text, re.M)
        cnt = re.search(r"^run_cnt:\s+(\d+)", text, re.M)
        out[name] = (int(ns.group(1)) if ns else 0, int(cnt.group(1)) if cnt else 0)
    return out


def cost_helper(mode: str, pid: int, seconds: float, out: str) -> None:
    """One sampler on `pid` (this process runs the session); prints per-program deltas over the window after
    COST_WARMUP_S of capture. `mode`: "cfi" or "fp", then optionally ":HZ" (COST_HZ) and ":K" (the firings per
    kept sample, keep_one_in; 0 chooses as aiflame does)."""
    from aiflame.agent.kernel.sampler import SamplerConfig
    from aiflame.agent.session import Session, SessionConfig, SessionStats

    parts = mode.split(":")
    walk, hz, keep = parts[0], parts[1] if len(parts) > 1 else str(COST_HZ), parts[2] if len(parts) > 2 else "0"
    cfg = SessionConfig(out_dir=Path(out), pid=pid, duration_s=COST_WARMUP_S + seconds,
                        sampler=SamplerConfig(frequency=int(hz), event="cpu-clock", cfi=walk == "cfi",
                                              keep_one_in=int(keep)),
                        runtimes=False, gpu_samples=False)
    marks: list[tuple[float, int, dict[str, tuple[int, int]]]] = []
    session: Session

    def on_progress(stats: SessionStats) -> None:
        sampler = session.pipeline.sampler
        obj = sampler._obj if sampler is not None else None
        if obj is None or stats.elapsed_s < COST_WARMUP_S:
            return
        progs = {n: fd for n, fd in obj.progs.items() if n in COST_PROGS}
        marks.append((stats.elapsed_s, stats.samples, _prog_stats(progs)))

    session = Session(cfg, on_progress=on_progress)
    result = session.run()
    (t0, s0, p0), (t1, s1, p1) = marks[0], marks[-1]
    per_prog = {n: {"ns": p1[n][0] - p0[n][0], "runs": p1[n][1] - p0[n][1]} for n in p1}
    samples = s1 - s0
    # tail calls run inside the program that made them: on_sample's time covers uw_sample_step and sample_finish
    total_ns = sum(v["ns"] for v in per_prog.values())
    from aiflame.core.capture import read_capture

    cap = read_capture(result.capture)
    depth = sum(len(s.user) for s in cap.samples) / max(1, len(cap.samples))
    print(json.dumps({"mode": mode, "window_s": t1 - t0, "samples": samples,
                      "ns_per_sample": total_ns / max(1, samples), "user_frames_per_sample": depth,
                      "programs": per_prog, "lost": result.stats.lost,
                      "unwind_counters": {k: v for k, v in result.stats.counters.items() if k.startswith("uw")}}))


def cost_figures(tmp: Path, target_cmd: list[str], seconds: float,
                 modes: tuple[str, str] = ("cfi", f"fp:{COST_HZ_OTHER}")) -> dict[str, object]:
    """Two samplers on one target at once; "ratio" is the first mode's in-kernel cost per sample over the
    second's (cost_helper's modes)."""
    # the target alone on the last CPU, the two agents (draining, symbolizing) on the others
    cpus = sorted(os.sched_getaffinity(0))
    others = set(cpus[:-1]) or set(cpus)
    if len(cpus) > 1:
        target_cmd = ["taskset", "-c", str(cpus[-1]), *target_cmd]
    target = subprocess.Popen(target_cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        time.sleep(2)  # past the import (torch) into the steady loop
        helpers = {mode: subprocess.Popen([sys.executable, __file__, "--cost-helper", mode, str(target.pid),
                                           str(seconds), str(tmp / f"cost-{mode.replace(':', '-')}")],
                                          cwd=REPO, stdout=subprocess.PIPE, text=True,
                                          preexec_fn=lambda: os.sched_setaffinity(0, others))
                   for mode in modes}
        results = {}
        for mode, h in helpers.items():
            stdout, _ = h.communicate(timeout=600)
            if h.returncode:
                raise SystemExit(f"cost helper {mode} failed ({h.returncode})")
            results[mode] = json.loads(stdout.strip().splitlines()[-1])
    finally:
        target.kill()
        target.wait()
    first, second = (results[m]["ns_per_sample"] for m in modes)
    return {**results, "ratio": first / second if second else 0.0}


def loss_figures(tmp: Path, exe: Path, seconds: float) -> dict[str, object]:
    from aiflame.core.capture import read_capture

    cpus = os.cpu_count() or 1
    work = " & ".join([f"{exe} {seconds + 30}"] * cpus) + " & wait"
    out = tmp / "loss"
    subprocess.run(aiflame_cmd("profile", "-q", "-F", "999", "-d", str(seconds), "-o", str(out), "--formats",
                               "folded", "--", "sh", "-c", work), cwd=REPO, check=True, stdout=subprocess.DEVNULL)
    cap = read_capture(out / "profile.aiflame")
    for pid in {s.pid for s in cap.samples}:  # the capture stopped at -d: its workload still runs
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    assert cap.footer is not None
    c = cap.footer.counters
    stops = [s.unwind & 0xFF for s in cap.samples if s.comm.startswith("unwind_work")]
    return {"duration_s": seconds, "cpus": cpus, "samples": len(cap.samples),
            "expected_if_always_on_cpu": 999 * cpus * seconds, "lost": c.get("lost", 0),
            "uw_tailcall_fail": c.get("uw_tailcall_fail", 0),
            "walks_reaching_end": sum(1 for x in stops if x == 1) / max(1, len(stops)),
            "agent_cpu_pct_of_core": 100 * cap.footer.agent_cpu_s / seconds}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--loss-s", type=float, default=60.0, help="seconds of the 999 Hz loss run (60)")
    ap.add_argument("--cost-s", type=float, default=20.0, help="seconds of each in-kernel cost window (20)")
    ap.add_argument("--no-save", action="store_true")
    ap.add_argument("--cost-helper", nargs=4, metavar=("MODE", "PID", "SECONDS", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.cost_helper:
        mode, pid, seconds, out = args.cost_helper
        cost_helper(mode, int(pid), float(seconds), out)
        return 0
    result: dict[str, Any] = {"conditions": {**conditions(), "load_average_start": os.getloadavg()[0]}}
    with tempfile.TemporaryDirectory(prefix="aiflame-bench-unwind-") as td:
        tmp = Path(td)
        cache = tmp / "cache"
        os.environ["AIFLAME_CACHE"] = str(cache)  # every aiflame below starts from this (empty) cache
        steps: list[tuple[str, Any]] = [
            ("capture", lambda: capture_figures(tmp, cache)),
            ("tables", lambda: table_figures(tmp)),
            ("oracle", lambda: oracle_figures(tmp)),
        ]
        for name, fn in steps:
            t = time.monotonic()
            result[name] = fn()
            print(f"== {name} ({time.monotonic() - t:.0f} s)\n{json.dumps(result[name], indent=2)}", flush=True)
        exe = build_c_workload(tmp / "c", "-O1")
        set_bpf_stats(True)
        try:
            result["cost_c_O1"] = cost_figures(tmp, [str(exe), "600"], args.cost_s)
            print(f"== cost_c_O1\n{json.dumps(result['cost_c_O1'], indent=2)}", flush=True)
            result["cost_torch"] = cost_figures(tmp, [sys.executable, str(TORCH_WORK), "600"], args.cost_s)
            print(f"== cost_torch\n{json.dumps(result['cost_torch'], indent=2)}", flush=True)
        finally:
            set_bpf_stats(False)
        result["loss"] = loss_figures(tmp, exe, args.loss_s)
        print(f"== loss\n{json.dumps(result['loss'], indent=2)}", flush=True)
    result["conditions"]["load_average_end"] = os.getloadavg()[0]
    with open("/proc/stat") as f:
        result["conditions"]["steal_ticks_end"] = int(f.readline().split()[8])
    if not args.no_save:
        print(f"saved {save('unwind', result)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

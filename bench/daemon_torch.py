"""The daemon's memory with a real job: `aiflame agent` (5 s windows) watching a 2-rank gloo DDP job
(examples/ddp_gloo.py), which it selects by its runtime libraries and probes in libtorch_cpu.so. Reports the
daemon's peak RSS (VmHWM), its RSS at the end and the peak of the daemon with its children (the BPF compiler).

    sudo .venv/bin/python bench/daemon_torch.py [--steps 120] [--tree DIR]

--tree runs the agent of another checkout (e.g. an older commit in a worktree) against the same job.
Goal (#20): peak RSS < 300 MB.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import psutil
from common import REPO


def _status_mb(pid: int) -> dict[str, float]:
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(value.split()[0]) / 1024
    return out


def _tree_mb(pid: int) -> float:
    proc = psutil.Process(pid)
    total = proc.memory_info().rss
    for child in proc.children(recursive=True):
        try:
            total += child.memory_info().rss
        except psutil.Error:
            pass
    return total / 2**20


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", default="120", help="DDP steps of the job (120: about a minute here)")
    ap.add_argument("--tree", default=str(REPO), help="the checkout whose agent runs (default: this one)")
    args = ap.parse_args()
    env = {**os.environ, "PYTHONPATH": args.tree}
    with tempfile.TemporaryDirectory() as tmp:
        t = Path(tmp)
        config = t / "aiflame.toml"
        config.write_text(textwrap.dedent(f"""
            [watch]
            scan_interval_s = 0.2
            [continuous]
            window_s = 5
            [output]
            dir = "{t / 'out'}"
            [control]
            socket = "{t / 'sock'}"
        """))
        log = t / "log"
        with open(log, "wb") as log_f:
            agent = subprocess.Popen([sys.executable, "-m", "aiflame", "agent", "--config", str(config)],
                                     cwd=args.tree, env=env, stdout=log_f, stderr=subprocess.STDOUT)
            deadline = time.monotonic() + 120
            while b"INFO started" not in log.read_bytes():
                if agent.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"the agent did not start:\n{log.read_text(errors='replace')}")
                time.sleep(0.1)
            job = subprocess.Popen([sys.executable, str(REPO / "examples" / "ddp_gloo.py"), "--steps", args.steps],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            peak_tree = 0.0
            end = None
            while end is None or time.monotonic() < end:
                peak_tree = max(peak_tree, _tree_mb(agent.pid))
                if end is None and job.poll() is not None:
                    end = time.monotonic() + 10  # two more windows exported
                time.sleep(0.5)
            last = _status_mb(agent.pid)
            agent.terminate()
            agent.wait(60)
        windows = log.read_text(errors="replace").count("window")
    print(f"{args.tree}: agent peak RSS (VmHWM) {last['VmHWM']:.0f} MB, RSS at the end {last['VmRSS']:.0f} MB, "
          f"peak with its children {peak_tree:.0f} MB; {windows} window lines in its log")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Daemon cost: `aiflame agent` at 19 Hz watching a busy 2-thread target (examples/bin/bench_work-like load in
Python threads would hold the GIL, so the target is a C program: two threads spinning, linked to nothing
special, selected by name). Reports the agent's CPU (% of a core over a watched run, start-up excluded), its
RSS, and the target's slowdown: work per second of the watched program against the same binary under a name the
daemon does not select, run in alternating pairs while the daemon runs, median of the pair ratios.

    sudo .venv/bin/python bench/bench_daemon.py [--seconds 60]
Goals: agent CPU <= 0.3% of a core, RSS <= 100 MB, target slowdown <= 0.5%.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
from common import REPO, rss_mb

SPIN = r"""
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
static double secs;
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec / 1e9; }
__attribute__((noinline)) static unsigned long work(void) {
  unsigned long x = 1; for (int i = 0; i < 100000; i++) x = x * 6364136223846793005UL + 1; return x; }
static void *loop(void *out) {
  double end = now() + secs; unsigned long n = 0, s = 0;
  while (now() < end) { s += work(); n++; }
  *(unsigned long *)out = n + (s == 42); return NULL; }
int main(int argc, char **argv) { secs = atof(argv[1]); pthread_t t[2]; unsigned long n[2];
  for (int i = 0; i < 2; i++) pthread_create(&t[i], NULL, loop, &n[i]);
  for (int i = 0; i < 2; i++) pthread_join(t[i], NULL);
  printf("%lu\n", n[0] + n[1]); return 0; }
"""


def _cpu_s(pid: int) -> float:
    t = psutil.Process(pid).cpu_times()
    return t.user + t.system


def _rss_split_mb(pid: int) -> str:
    """Anonymous vs file-backed resident memory (file pages are mostly shared libraries: LLVM inside libbcc).
    From /proc/PID/status: psutil folds file-backed and shared memory into one `shared`."""
    kb = {k: int(v.split()[0]) for k, v in (line.split(":", 1) for line in
          Path(f"/proc/{pid}/status").read_text().splitlines() if line.startswith(("RssAnon", "RssFile", "RssShmem")))}
    return ", ".join(f"{k[3:].lower()} {v / 1024:.1f}" for k, v in kb.items())


def _run_target(exe: Path, seconds: float) -> float:
    out = subprocess.run([str(exe), str(seconds)], capture_output=True, text=True, check=True).stdout
    return int(out) / seconds


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=60.0, help="watched run for the agent's CPU and RSS")
    ap.add_argument("--pairs", type=int, default=6, help="watched/unwatched pairs for the slowdown")
    ap.add_argument("--pair-seconds", type=float, default=10.0)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="aiflame-bench-daemon-"))
    (tmp / "spin2.c").write_text(SPIN)
    exe = tmp / "aiflame_spin2"
    subprocess.run(["gcc", "-O1", "-fno-omit-frame-pointer", "-o", str(exe), str(tmp / "spin2.c"), "-lpthread"],
                   check=True)
    plain = tmp / "plain_spin2"  # the same program under a name the daemon does not select
    plain.write_bytes(exe.read_bytes())
    plain.chmod(0o755)
    (tmp / "c.toml").write_text(f'[watch]\nnames = ["aiflame_spin2"]\n'
                                f'[output]\ndir = "{tmp}/out"\n[control]\nsocket = "{tmp}/s.sock"\n')
    log = open(tmp / "daemon.log", "wb")
    d = subprocess.Popen([sys.executable, "-m", "aiflame", "agent", "--config", str(tmp / "c.toml")],
                         cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    ratios = []
    try:
        while b"INFO started" not in (tmp / "daemon.log").read_bytes():
            if d.poll() is not None:
                raise SystemExit((tmp / "daemon.log").read_text())
            time.sleep(0.2)
        time.sleep(2)
        cpu0, t0 = _cpu_s(d.pid), time.monotonic()
        _run_target(exe, args.seconds)
        cpu = _cpu_s(d.pid) - cpu0
        elapsed = time.monotonic() - t0
        rss = rss_mb(d.pid)
        split = _rss_split_mb(d.pid)
        # Slowdown: watched vs. unwatched runs interleaved (order alternating), the ratio of each pair, median.
        for i in range(args.pairs):
            order = [exe, plain] if i % 2 == 0 else [plain, exe]
            rate = {str(e): _run_target(e, args.pair_seconds) for e in order}
            ratios.append(rate[str(exe)] / rate[str(plain)])
    finally:
        d.terminate()
        d.wait(120)
    ratios.sort()
    median = statistics.median(ratios)
    print(f"agent CPU {100 * cpu / elapsed:.3f}% of a core (goal <= 0.3%)")
    print(f"agent RSS {rss:.1f} MB (goal <= 100 MB; MB {split})")
    print(f"target slowdown {100 * (1 - median):.2f}% median of {len(ratios)} interleaved pairs "
          f"(each {', '.join(f'{100 * (1 - r):.2f}' for r in ratios)}; goal <= 0.5%)")
    print(f"log: {tmp / 'daemon.log'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

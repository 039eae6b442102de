"""Soak test of the daemon (minutes; not in CI): hundreds of short-lived targets that map an accelerator
runtime start, fork and exit while the daemon runs with short windows. Prints the daemon's RSS, open
descriptors and BPF links over time; they must stay flat.

    sudo .venv/bin/python bench/soak_daemon.py [--targets 300] [--parallel 4]
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

from common import REPO, rss_mb

TARGET = textwrap.dedent("""
    import ctypes, os, sys, time
    ctypes.CDLL(sys.argv[1])
    end = time.time() + float(sys.argv[2])
    if os.fork() == 0:
        while time.time() < end: pass
        os._exit(0)
    while time.time() < end: pass
    os.wait()
""")


def _libnccl() -> str:
    for root in sys.path:
        lib = Path(root) / "nvidia" / "nccl" / "lib" / "libnccl.so.2"
        if lib.is_file():
            return str(lib)
    raise SystemExit("libnccl.so.2 not found (make setup installs the accel-test extra)")


def _sample(pid: int) -> tuple[float, int, int]:
    fds = os.listdir(f"/proc/{pid}/fd")
    return rss_mb(pid), len(fds), sum(1 for f in fds if _fd_target(pid, f).startswith("anon_inode:bpf_link"))


def _fd_target(pid: int, fd: str) -> str:
    try:
        return os.readlink(f"/proc/{pid}/fd/{fd}")
    except FileNotFoundError:  # closed since the listing
        return ""


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--targets", type=int, default=300)
    ap.add_argument("--parallel", type=int, default=4)
    ap.add_argument("--life", type=float, default=0.5, help="seconds each target runs")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="aiflame-soak-"))
    (tmp / "t.py").write_text(TARGET)
    (tmp / "c.toml").write_text(f'[watch]\nscan_interval_s = 0.2\n[continuous]\nwindow_s = 5\n'
                                f'[output]\ndir = "{tmp}/out"\n[control]\nsocket = "{tmp}/s.sock"\n')
    log = open(tmp / "daemon.log", "wb")
    d = subprocess.Popen([sys.executable, "-m", "aiflame", "agent", "--config", str(tmp / "c.toml")],
                         cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    try:
        return _soak(args, tmp, d)
    finally:
        if d.poll() is None:
            d.terminate()
            d.wait(120)


def _soak(args: argparse.Namespace, tmp: Path, d: subprocess.Popen[bytes]) -> int:
    while b"INFO started" not in (tmp / "daemon.log").read_bytes():
        time.sleep(0.2)
    lib = _libnccl()
    print("targets  rss_mb  fds  bpf_links")
    started = 0
    running: list[subprocess.Popen[bytes]] = []
    first = None
    while started < args.targets or running:
        running = [p for p in running if p.poll() is None]
        while started < args.targets and len(running) < args.parallel:
            running.append(subprocess.Popen([sys.executable, str(tmp / "t.py"), lib, str(args.life)]))
            started += 1
            if started % 50 == 0:
                rss, fds, links = _sample(d.pid)
                first = first or (rss, fds, links)
                print(f"{started:7d}  {rss:6.1f}  {fds:3d}  {links:9d}", flush=True)
        time.sleep(0.05)
    time.sleep(8)
    rss, fds, links = _sample(d.pid)
    print(f"{'end':>7}  {rss:6.1f}  {fds:3d}  {links:9d}")
    d.terminate()
    d.wait(120)
    if first:
        print(f"growth: rss {rss - first[0]:+.1f} MB, fds {fds - first[1]:+d}, bpf links {links - first[2]:+d}")
    print(f"log and windows in {tmp}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

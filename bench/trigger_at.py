"""`trigger --at` across daemons: two real `aiflame agent` daemons (real BPF, each its own socket, output and
config, as two nodes' daemons would be) watch one idle process each; both are asked for a capture at the same
TIME, and the capture's `started_ns` (when the window opened, read from the sampler's clock) is compared between
them and with TIME. Two daemons on one host share a clock, so this measures what the daemons add (main-loop wake
to window open); across hosts add what NTP/PTP leaves between the clocks, which the join removes.

    sudo .venv/bin/python bench/trigger_at.py [--rounds 5] [--lead 30]
Goal (issue #29): the two windows open within 10 ms of each other.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from common import REPO

from aiflame.agent.daemon.protocol import TriggerRequest, request

IDLE = "import sys, time\nwhile True: time.sleep(1)\n"


def _daemon(tmp: Path, name: str) -> tuple[subprocess.Popen[bytes], Path, Path]:
    d = tmp / name
    d.mkdir()
    sock = d / "agent.sock"
    (d / "c.toml").write_text(f'[watch]\naccelerators = false\nnames = ["aiflame_idle_{name}"]\n'
                              f'scan_interval_s = 0.2\n[output]\ndir = "{d}/out"\n[control]\nsocket = "{sock}"\n')
    log = d / "daemon.log"
    p = subprocess.Popen([sys.executable, "-m", "aiflame", "agent", "--config", str(d / "c.toml")],
                         cwd=REPO, stdout=open(log, "wb"), stderr=subprocess.STDOUT)
    return p, sock, log


def _request(sock: Path, pid: int, at_ns: int, out: dict[str, object]) -> None:
    """One trigger over the control socket, answered when the capture has ended."""
    resp = request(str(sock), TriggerRequest((pid,), duration_s=1.0, at_wall_ns=at_ns), timeout_s=600)
    out.update(resp.data if resp.ok else {"error": resp.error})


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--lead", type=float, default=30.0, help="seconds between asking and TIME (covers BPF loads)")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="aiflame-bench-at-"))
    procs: list[subprocess.Popen[bytes]] = []
    daemons = []
    try:
        for name in ("a", "b"):
            exe = tmp / f"aiflame_idle_{name}"
            exe.symlink_to(sys.executable)  # the name discovery selects; one idle Python per daemon
            procs.append(subprocess.Popen([str(exe), "-c", IDLE]))
            p, sock, log = _daemon(tmp, name)
            procs.append(p)
            daemons.append((sock, log, procs[-2].pid))
        for _, log, _ in daemons:
            while b"INFO started" not in log.read_bytes():
                time.sleep(0.2)
        time.sleep(2)  # a scan has seen the targets
        apart: list[float] = []
        late: list[float] = []
        for r in range(args.rounds):
            at = time.time_ns() + int(args.lead * 1e9)
            got: list[dict[str, object]] = [{}, {}]
            ts = [threading.Thread(target=_request, args=(sock, pid, at, got[i]))
                  for i, (sock, _, pid) in enumerate(daemons)]
            for t in ts:
                t.start()
            for t in ts:
                t.join()
            s0, s1 = got[0].get("started_ns"), got[1].get("started_ns")
            if not isinstance(s0, int) or not isinstance(s1, int):
                raise SystemExit(f"round {r}: {got}")
            apart.append(abs(s0 - s1) / 1e6)
            late.extend(((s0 - at) / 1e6, (s1 - at) / 1e6))
            print(f"round {r}: windows {apart[-1]:.2f} ms apart, opened {late[-2]:+.2f} / {late[-1]:+.2f} ms "
                  f"from TIME", flush=True)
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(120)
    print(f"two daemons, same TIME: windows {statistics.median(apart):.2f} ms apart (median of {len(apart)}, "
          f"max {max(apart):.2f}; goal <= 10 ms); opened {min(late):+.2f} .. {max(late):+.2f} ms from TIME")
    return 0


if __name__ == "__main__":
    sys.exit(main())

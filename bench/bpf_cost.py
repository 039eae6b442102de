"""In-kernel cost per sample, aiflame vs bcc's `profile`, both attached to the same target at the same time, so
host noise hits both equally: kernel.bpf_stats_enabled run_time_ns / run_cnt over a 20 s window."""

from __future__ import annotations

import json
import signal
import subprocess
import time

from common import EXAMPLES, aiflame_cmd, bpf_prog_stats, conditions, save, set_bpf_stats

WINDOW_S = 20.0


def main() -> None:
    set_bpf_stats(True)
    target = subprocess.Popen([str(EXAMPLES / "bench_work"), "2", "100000", "0"], stdout=subprocess.DEVNULL)
    procs = {
        "aiflame": subprocess.Popen(aiflame_cmd("profile", "-q", "-p", str(target.pid), "-F", "99", "-o",
                                                "/tmp/aiflame-bpf-cost", "--formats", "folded")),
        "bcc_profile": subprocess.Popen(["/usr/sbin/profile-bpfcc", "-F", "99", "-p", str(target.pid), "-f", "600"],
                                        stdout=subprocess.DEVNULL),
    }
    try:
        time.sleep(12)  # both compiled and attached
        before = {k: bpf_prog_stats(p.pid) for k, p in procs.items()}
        time.sleep(WINDOW_S)
        after = {k: bpf_prog_stats(p.pid) for k, p in procs.items()}
    finally:
        target.kill()
        for p in procs.values():
            p.send_signal(signal.SIGINT)
        for p in procs.values():
            p.wait(timeout=120)
        set_bpf_stats(False)
    result: dict[str, object] = {"conditions": {**conditions(), "hz": 99, "window_s": WINDOW_S}}
    for k in procs:
        runs = after[k][1] - before[k][1]
        result[k] = {"ns_per_run": (after[k][0] - before[k][0]) / max(1, runs), "runs": runs}
    with open("/proc/stat") as f:
        result["steal_ticks_now"] = int(f.readline().split()[8])
    print(json.dumps(result, indent=2))
    print(f"saved {save('bpf_cost', result)}")


if __name__ == "__main__":
    main()

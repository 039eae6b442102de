"""A periodic Python workload with a known split, for the sampling-bias bench (bench/split_bias.py): two threads,
each running f60, f30 and f10 in a FIXED order, so the loop has a fixed period that a sampler on a regular
clock can lock onto. Each function spins for its share (60/30/10) of a quantum, on the thread's CPU clock
(default) or on the wall clock (SPLIT_CLOCK=wall: GIL waits then shift the on-CPU split from run to run).
Either way the workload measures the CPU time each function really used (thread_time around each call) and,
given a third argument, writes those truths as JSON there: the oracle the sampled shares are compared with.

Usage: python split_work.py SECONDS [QUANTUM_MS] [TRUTH.json]   (prints "ready" once both threads run)
"""

import json
import os
import sys
import threading
import time

CLOCK = time.perf_counter if os.environ.get("SPLIT_CLOCK") == "wall" else time.thread_time
USED = {"f60": 0.0, "f30": 0.0, "f10": 0.0}
LOCK = threading.Lock()


def burn(until: float) -> int:
    x = 0
    while CLOCK() < until:
        x += 1
    return x


def f60(q: float) -> int:
    return burn(CLOCK() + 0.6 * q)


def f30(q: float) -> int:
    return burn(CLOCK() + 0.3 * q)


def f10(q: float) -> int:
    return burn(CLOCK() + 0.1 * q)


def loop(end: float, q: float) -> None:
    used = dict.fromkeys(USED, 0.0)
    while time.monotonic() < end:
        for f in (f60, f30, f10):
            t0 = time.thread_time()
            f(q)
            used[f.__name__] += time.thread_time() - t0
    with LOCK:
        for k, v in used.items():
            USED[k] += v


def main() -> None:
    seconds = float(sys.argv[1]) if len(sys.argv) > 1 else 10.0
    q = (float(sys.argv[2]) if len(sys.argv) > 2 else 20.0) / 1000.0
    end = time.monotonic() + seconds
    t = threading.Thread(target=loop, args=(end, q), name="second")
    t.start()
    print("ready", flush=True)
    loop(end, q)
    t.join()
    if len(sys.argv) > 3:
        with open(sys.argv[3], "w") as f:
            json.dump(USED, f)


if __name__ == "__main__":
    main()

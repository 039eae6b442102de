"""Kernel launches driven from Python: the -shared build of tests/cuda/launch_loop.cu called through ctypes from a
Python function 20 calls deep, so every launch's stack holds `launch_from_python` (or `op`) under native frames.

    python launch_py.py LIBRARY SECONDS RATE          run_loop() at RATE launches a second (bench/launch_rate.py);
                                                      prints {"hot": N, "cold": M} as the program does
    python launch_py.py LIBRARY SECONDS steps SPIN    unpaced steps of 100 launches, each after SPIN iterations
                                                      of a Python loop, as a training step dispatches its kernels
                                                      (bench/launch_steps.py); prints the counts and
                                                      {"steps": N, "seconds": S, "steps_per_s": R, "cpu_s":
                                                      the process's CPU time over them, "steps_per_cpu_s": ...}
    python launch_py.py LIBRARY SECONDS log SPIN      the same steps, printing "CLOCK_MONOTONIC_NS STEPS" every 25 steps
                                                      (bench/launch_steps.py --attach reads the rate in and out of
                                                      the windows it profiles), then the counts
    python launch_py.py LIBRARY 0 calibrate WORK_US   prints {"spin": SPIN}: iterations taking WORK_US here
                                                      (every run of a comparison uses the same SPIN)
"""

from __future__ import annotations

import ctypes
import json
import sys
import time

OPS_PER_STEP = 100


def launch_from_python(lib: ctypes.CDLL, seconds: float, rate: int) -> dict[str, float]:
    hot, cold = ctypes.c_long(), ctypes.c_long()
    lib.run_loop(ctypes.c_double(seconds), ctypes.c_long(rate), ctypes.byref(hot), ctypes.byref(cold))
    return {"hot": hot.value, "cold": cold.value}


def _spin(n: int) -> int:
    x = 0
    for i in range(n):
        x ^= i
    return x


def _iterations_for(us: float) -> int:
    """Loop iterations of _spin taking `us` microseconds here (the median of 5 timings of 20,000)."""
    times = []
    for _ in range(5):
        t = time.perf_counter()
        _spin(20_000)
        times.append(time.perf_counter() - t)
    return max(1, round(us * 1e-6 / (sorted(times)[2] / 20_000)))


def op(lib: ctypes.CDLL, spin: int) -> int:
    _spin(spin)
    return int(lib.launch_one())


def steps(lib: ctypes.CDLL, seconds: float, spin: int, log: bool = False) -> dict[str, float]:
    hot = n = 0
    t0, c0 = time.perf_counter(), time.process_time()
    while (elapsed := time.perf_counter() - t0) < seconds:
        for _ in range(OPS_PER_STEP):
            hot += op(lib, spin)
        n += 1
        if log and n % 25 == 0:
            print(time.monotonic_ns(), n, flush=True)
    cpu = time.process_time() - c0
    return {"hot": hot, "cold": n * OPS_PER_STEP - hot, "steps": n, "seconds": elapsed, "steps_per_s": n / elapsed,
            "cpu_s": cpu, "steps_per_cpu_s": n / cpu if cpu > 0 else 0.0}


def nested(depth: int, lib: ctypes.CDLL, seconds: float, mode: str, work: str) -> dict[str, float]:
    if depth:
        return nested(depth - 1, lib, seconds, mode, work)
    if mode in ("steps", "log"):
        return steps(lib, seconds, int(work), log=mode == "log")
    if mode == "calibrate":
        return {"spin": _iterations_for(float(work))}
    return launch_from_python(lib, seconds, int(mode))


if __name__ == "__main__":
    library = ctypes.CDLL(sys.argv[1])
    print(json.dumps(nested(20, library, float(sys.argv[2]), sys.argv[3], (sys.argv[4:] or ["0"])[0])), flush=True)

"""Kernel launches driven from Python (bench/launch_rate.py --python): the -shared build of
tests/cuda/launch_loop.cu, its run_loop() called through ctypes from a Python function 20 calls deep, so every
launch's stack holds `launch_from_python` under native frames. Prints {"hot": N, "cold": M} as the program does.

    python launch_py.py LIBRARY SECONDS RATE
"""

from __future__ import annotations

import ctypes
import json
import sys


def launch_from_python(lib: ctypes.CDLL, seconds: float, rate: int) -> dict[str, int]:
    hot, cold = ctypes.c_long(), ctypes.c_long()
    lib.run_loop(ctypes.c_double(seconds), ctypes.c_long(rate), ctypes.byref(hot), ctypes.byref(cold))
    return {"hot": hot.value, "cold": cold.value}


def nested(depth: int, lib: ctypes.CDLL, seconds: float, rate: int) -> dict[str, int]:
    if depth:
        return nested(depth - 1, lib, seconds, rate)
    return launch_from_python(lib, seconds, rate)


if __name__ == "__main__":
    library = ctypes.CDLL(sys.argv[1])
    print(json.dumps(nested(20, library, float(sys.argv[2]), int(sys.argv[3]))), flush=True)

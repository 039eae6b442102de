"""Half asleep, half on CPU: each round sleeps SLICE seconds in `sleeper` and computes SLICE seconds of its own CPU
time in `computer` (measured with time.thread_time(), so the work is the same however busy the host is). The
off-CPU test's oracle: both hold the same time in `--view wall`, 50:50.

Usage: python offcpu_split.py ROUNDS SLICE_S
"""

import sys
import time


def spin(n: int) -> int:
    total = 0
    for i in range(n):
        total += i * i
    return total


def computer(slice_s: float) -> None:
    end = time.thread_time() + slice_s
    while time.thread_time() < end:
        spin(2000)


def sleeper(slice_s: float) -> None:
    time.sleep(slice_s)


def main() -> None:
    rounds, slice_s = int(sys.argv[1]), float(sys.argv[2])
    for _ in range(rounds):
        sleeper(slice_s)
        computer(slice_s)


if __name__ == "__main__":
    main()

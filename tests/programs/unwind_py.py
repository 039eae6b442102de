"""Pure-Python workload of tests/integration/test_unwind_vs_perf.py: the main thread and one worker thread each
burn ARGV[1] seconds of their own CPU time in Python code a few frames deep (a recursion, a list comprehension
calling back into Python, a builtin calling back into Python through map)."""

import sys
import threading
import time


def leaf(n: int) -> int:
    total = 0
    for i in range(n):
        total += i * i
    return total


def recurse(depth: int, n: int) -> int:
    if depth == 0:
        return leaf(n)
    return recurse(depth - 1, n) + 1


def through_map(n: int) -> int:
    return sum(map(leaf, [n // 4] * 4))


def comprehension(n: int) -> int:
    return sum([leaf(n // 4) for _ in range(4)])


def burn(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        recurse(5, 2000)
        through_map(2000)
        comprehension(2000)


def worker(seconds: float) -> None:
    burn(seconds)


def main() -> None:
    seconds = float(sys.argv[1]) if len(sys.argv) > 1 else 1.0
    t = threading.Thread(target=worker, args=(seconds,))
    t.start()
    burn(seconds)
    t.join()


if __name__ == "__main__":
    main()

"""Fixed Python work on 2 threads for the overhead benchmark: waits for a byte on stdin (so the profiler can
attach first), runs ROUNDS rounds per thread, prints wall and process CPU seconds."""

import sys
import threading
import time


def spin(n: int) -> int:
    total = 0
    for i in range(n):
        total += i * i
    return total


def inner(rounds: int) -> None:
    for _ in range(rounds):
        spin(2000)


def outer(rounds: int) -> None:
    inner(rounds)


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 3000
    sys.stdin.read(1)
    t0, c0 = time.monotonic(), time.process_time()
    t = threading.Thread(target=outer, args=(rounds,))
    t.start()
    outer(rounds)
    t.join()
    print(f"{time.monotonic() - t0:.6f} {time.process_time() - c0:.6f}", flush=True)


if __name__ == "__main__":
    main()

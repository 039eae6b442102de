"""Known Python split for tests and demos: the main thread spends 60/40 of its work in work_60/work_40 (depth 4:
<module> -> main -> level -> work_NN -> spin), a second thread 75/25 in task_75/task_25. `spin` has one hot line.
Each round calls one of the pair, picked at random: a fixed call order has a fixed period, and a sampler whose
period nearly divides it keeps landing on the same phase (measured: the 60/40 split read anywhere from 57 to 64).

Usage: python py_split.py [seconds]   (prints "ready" once both threads are running)
"""

import random
import sys
import threading
import time


def spin(n):
    total = 0
    for i in range(n):
        total += i * i  # HOT LINE
    return total


def work_60():
    return spin(6000)


def work_40():
    return spin(4000)


def task_75():
    return spin(7500)


def task_25():
    return spin(2500)


def level(end):
    pick = random.Random(60).random
    while time.monotonic() < end:
        if pick() < 0.5:
            work_60()
        else:
            work_40()


def worker(end):
    pick = random.Random(75).random
    while time.monotonic() < end:
        if pick() < 0.5:
            task_75()
        else:
            task_25()


def main():
    seconds = float(sys.argv[1]) if len(sys.argv) > 1 else 5.0
    end = time.monotonic() + seconds
    t = threading.Thread(target=worker, args=(end,), name="worker")
    t.start()
    print("ready", flush=True)
    level(end)
    t.join()


if __name__ == "__main__":
    main()

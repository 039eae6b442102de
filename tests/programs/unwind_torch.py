"""The PyTorch operator-dispatcher loop of tests/integration/test_unwind_vs_perf.py and bench/bench_unwind.py:
tiny tensors on one thread, so the time goes to Python and libtorch's dispatch, not to arithmetic. Runs for
ARGV[1] seconds of CPU time after the import."""

import sys
import time

import torch


def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    x = x + y
    return x * 0.5


def main() -> None:
    seconds = float(sys.argv[1]) if len(sys.argv) > 1 else 2.0
    torch.set_num_threads(1)
    x, y = torch.ones(8), torch.ones(8)
    end = time.process_time() + seconds
    while time.process_time() < end:
        for _ in range(1000):
            x = step(x, y)


if __name__ == "__main__":
    main()

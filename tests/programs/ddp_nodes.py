"""A small data-parallel training job for torchrun across nodes: an MLP trained with DDP over gloo, every rank
the same number of steps (a fixed amount of work), and an all-reduce of the loss after each step. Prints one line
per rank at the end: its rank and how many steps it ran."""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from torch import nn


def main() -> int:
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 20
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(rank)
    model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(128, 512), nn.ReLU(), nn.Linear(512, 10)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(steps):
        x, y = torch.randn(64, 128), torch.randint(0, 10, (64,))
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step()
        dist.all_reduce(loss.detach())
    dist.barrier()
    print(f"rank {rank} of {dist.get_world_size()} ran {steps} steps (pid {os.getpid()})", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""2-rank gloo jobs over localhost for calibrating and checking a simulated network (docs/chakra.md, "A network
that predicts other jobs"). Each starts its ranks as child processes, as `aiflame profile -- CMD` follows them.

    python examples/comm_jobs.py sweep    # every collective and send/recv at sizes 4 KiB .. 16 MiB: calibration
    python examples/comm_jobs.py small    # 5 steps: all-reduce 40 KB, all-gather, broadcast, send/recv
                                          # (--compute-ms N: N ms of compute before each step)
    python examples/comm_jobs.py mixed    # 20 steps: uneven compute, all-reduce 4 MiB, broadcast 1 MiB, uneven
                                          # all-to-all, barrier, send/recv 120 KB

The demo (`examples/ddp_gloo.py`) is the third job: DDP's bucketed all-reduces overlapped with backward.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys

WORLD = 2
KIB = 1 << 10
SWEEP_SIZES = [4 * KIB << (2 * i) for i in range(7)]  # 4 KiB .. 16 MiB, bytes per rank
SWEEP_REPS = 6


def _compute(ms: float) -> None:
    """About `ms` of single-threaded compute (matrix products), whatever the call costs on this host."""
    import time

    import torch as t

    a = t.randn(128, 128)
    end = time.thread_time() + ms / 1e3
    while time.thread_time() < end:
        a = t.tanh(a @ a)


def _job(name: str, rank: int, args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    other = 1 - rank
    f32 = 4

    def send_recv(nbytes: int, tag: int) -> None:
        mine, theirs = torch.ones(nbytes // f32), torch.empty(nbytes // f32)
        if rank == 0:
            dist.send(mine, dst=other, tag=tag)
            dist.recv(theirs, src=other, tag=tag + 1)
        else:
            dist.recv(theirs, src=other, tag=tag)
            dist.send(mine, dst=other, tag=tag + 1)

    if name == "sweep":
        for size in (s for s in SWEEP_SIZES if s <= args.max_kib * KIB):
            n = size // f32
            for _ in range(args.reps):
                dist.all_reduce(torch.ones(n))
                dist.all_gather([torch.empty(n) for _ in range(WORLD)], torch.ones(n))
                dist.broadcast(torch.ones(n), src=0)
                dist.all_to_all_single(torch.empty(n), torch.ones(n))
                send_recv(size, 10)
        return
    if name == "small":
        for step in range(5):
            if args.compute_ms:
                _compute(args.compute_ms)
            dist.all_reduce(torch.ones(10_000))  # 40 KB
            dist.all_gather([torch.empty(1000) for _ in range(WORLD)], torch.ones(1000))
            dist.broadcast(torch.ones(2500), src=0)
            send_recv(4 * KIB, 20 + 2 * step)
        return
    # mixed
    splits = ((30_000, 50_000), (70_000, 110_000))  # [rank][to rank] elements: uneven
    for step in range(20):
        _compute(15 if rank == 0 else 25)
        dist.all_reduce(torch.ones(1 << 20))  # 4 MiB
        dist.broadcast(torch.ones(1 << 18), src=0)  # 1 MiB
        recv = [splits[r][rank] for r in range(WORLD)]
        dist.all_to_all_single(torch.empty(sum(recv)), torch.ones(sum(splits[rank])), recv, list(splits[rank]))
        dist.barrier()
        send_recv(120_000, 40 + 2 * step)


def worker(name: str, args: argparse.Namespace) -> int:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    dist.barrier()  # both ranks up before the job (a profile --delay collective starts here)
    _job(name, rank, args)
    dist.barrier()
    dist.destroy_process_group()
    return 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("job", choices=("sweep", "small", "mixed"))
    ap.add_argument("--compute-ms", type=float, default=0.0, help="small: compute before each step (0)")
    ap.add_argument("--reps", type=int, default=SWEEP_REPS, help=f"sweep: calls of each kind per size ({SWEEP_REPS})")
    ap.add_argument("--max-kib", type=int, default=SWEEP_SIZES[-1] // KIB,
                    help=f"sweep: the largest size in KiB ({SWEEP_SIZES[-1] // KIB})")
    args = ap.parse_args()
    if "RANK" in os.environ:
        return worker(args.job, args)
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "WORLD_SIZE": str(WORLD),
           "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), *sys.argv[1:]],
                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}) for r in range(WORLD)]
    return max((p.wait() for p in procs), key=abs)


if __name__ == "__main__":
    sys.exit(main())

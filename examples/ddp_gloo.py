"""A 2-rank DDP training job over gloo on localhost, with one of every other gloo collective, that says exactly
which collectives each rank made.

Run it by itself (it starts its ranks as child processes, the way `aiflame profile -- CMD` follows them):
    python examples/ddp_gloo.py --steps 20 --expect out/expect.jsonl
or under torchrun:
    torchrun --standalone --nproc_per_node 2 examples/ddp_gloo.py --steps 20 --expect out/expect.jsonl

--expect PATH gets one JSON line per rank: {"rank", "world_size", "pid", "step_s", "step_cpu_s", "collectives"}:
wall and process CPU seconds per training step, and the collectives in the order the program issued them, each
{"type", "bytes", "peer", "root"}. The list is computed from what the program does (tensor sizes, DDP's
documented bucketing), not observed. Types are gloo's algorithm names; `bytes` means: allreduce, broadcast,
reduce: the buffer; allgather, gather: this rank's input; scatter: this rank's output; alltoallv
(all_to_all_single with splits): what this rank sends (its whole input); send, recv: the message; barrier: 0.
`peer` is the other rank of a send/recv (else null), `root` the root of broadcast/reduce/gather/scatter.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from typing import Any

WORLD = 2
# Layer widths of the MLP (no biases, so DDP's gradient-ready order is exactly reverse layer order).
WIDTHS = (256, 1024, 1024, 256, 10)
BATCH = 64
MIB = 1 << 20
FIRST_BUCKET = 1 * MIB  # torch.distributed._DEFAULT_FIRST_BUCKET_BYTES
BUCKET_CAP = 25 * MIB  # DDP's default bucket_cap_mb
BROADCAST_BUCKET = 250 * MIB  # DDP's broadcast_bucket_size for the initial state sync

# The extra collectives after training, in elements (float32 unless said otherwise).
ALL_GATHER = 1000
BROADCAST = 2500
ALL_REDUCE_I64 = 500
ALLTOALL_SPLITS = ((300, 500), (700, 1100))  # [rank][to rank] elements sent: uneven per rank
SEND = {0: 1234, 1: 4321}  # elements rank r sends to the other rank
REDUCE, REDUCE_ROOT = 1500, 1
GATHER, GATHER_ROOT = 600, 0
SCATTER, SCATTER_ROOT = 800, 1


def entry(kind: str, nbytes: int, peer: int | None = None, root: int | None = None) -> dict[str, Any]:
    return {"type": kind, "bytes": nbytes, "peer": peer, "root": root}


def ddp_buckets(param_bytes: list[int], limits: list[int]) -> list[int]:
    """Bucket sizes by DDP's greedy rule (compute_bucket_assignment_by_size): take tensors in gradient-ready
    order, close a bucket once it reaches the current limit, then move to the next limit (the last one repeats)."""
    out: list[int] = []
    size = 0
    li = 0
    for b in param_bytes:
        size += b
        if size >= limits[li]:
            out.append(size)
            size = 0
            li = min(li + 1, len(limits) - 1)
    if size:
        out.append(size)
    return out


def expected(rank: int, steps: int, shapes: list[tuple[int, ...]]) -> list[dict[str, Any]]:
    """The collectives this program makes on `rank`, in order."""
    sizes = [4 * _numel(s) for s in shapes]
    total = sum(sizes)
    out = [
        # DDP(): _verify_param_shape_across_processes: all_gather of the parameter count (one int64), then a
        # broadcast of every parameter's sizes and strides (int64), then the initial state sync from rank 0.
        entry("allgather", 8),
        entry("broadcast", 8 * sum(2 * len(s) for s in shapes), root=0),
    ]
    out += [entry("broadcast", b, root=0) for b in ddp_buckets(sizes, [BROADCAST_BUCKET])]
    # Step 1 reduces all gradients in one bucket; the forward of step 2 rebuilds the buckets in gradient-ready
    # order (reverse of definition) and broadcasts the new layout from rank 0: the int32 parameter indices plus
    # the bucket count, then the int32 bucket sizes.
    rebuilt = ddp_buckets(sizes[::-1], [FIRST_BUCKET, BUCKET_CAP])
    for step in range(steps):
        if step == 0:
            out.append(entry("allreduce", total))
            continue
        if step == 1:
            out += [entry("broadcast", 4 * (len(shapes) + 1), root=0), entry("broadcast", 4 * len(rebuilt), root=0)]
        out += [entry("allreduce", b) for b in rebuilt]
    other = 1 - rank
    send_first = rank == 0
    p2p = [entry("send", 4 * SEND[rank], peer=other), entry("recv", 4 * SEND[other], peer=other)]
    out += [
        entry("allgather", 4 * ALL_GATHER),
        entry("broadcast", 4 * BROADCAST, root=0),
        entry("allreduce", 8 * ALL_REDUCE_I64),
        entry("alltoallv", 4 * sum(ALLTOALL_SPLITS[rank])),  # uneven splits: gloo's alltoallv
        *(p2p if send_first else p2p[::-1]),
        entry("reduce", 4 * REDUCE, root=REDUCE_ROOT),
        entry("gather", 4 * GATHER, root=GATHER_ROOT),
        entry("scatter", 4 * SCATTER, root=SCATTER_ROOT),
        entry("barrier", 0),
    ]
    return out


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def worker(args: argparse.Namespace) -> int:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world != WORLD:
        raise SystemExit(f"ddp_gloo.py runs with {WORLD} ranks, not {world}")
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for i in range(len(WIDTHS) - 1):
        layers.append(torch.nn.Linear(WIDTHS[i], WIDTHS[i + 1], bias=False))
        if i < len(WIDTHS) - 2:
            layers.append(torch.nn.ReLU())
    model = torch.nn.Sequential(*layers)
    shapes = [tuple(p.shape) for p in model.parameters()]
    ddp = DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(rank)
    step_s: list[float] = []  # wall time per step
    step_cpu_s: list[float] = []  # CPU time of the whole process (all threads) per step
    for _ in range(args.steps):
        x = torch.randn(BATCH, WIDTHS[0], generator=gen)
        y = torch.randint(0, WIDTHS[-1], (BATCH,), generator=gen)
        t0, c0 = time.perf_counter(), time.process_time()
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(ddp(x), y)
        loss.backward()
        opt.step()
        step_s.append(time.perf_counter() - t0)
        step_cpu_s.append(time.process_time() - c0)

    # One of every other collective gloo has.
    other = 1 - rank
    outs = [torch.empty(ALL_GATHER) for _ in range(world)]
    dist.all_gather(outs, torch.full((ALL_GATHER,), float(rank)))
    dist.broadcast(torch.ones(BROADCAST) * rank, src=0)
    dist.all_reduce(torch.arange(ALL_REDUCE_I64, dtype=torch.int64))
    send_splits = list(ALLTOALL_SPLITS[rank])
    recv_splits = [ALLTOALL_SPLITS[r][rank] for r in range(world)]
    a2a_out = torch.empty(sum(recv_splits))
    dist.all_to_all_single(a2a_out, torch.ones(sum(send_splits)), recv_splits, send_splits)
    mine, theirs = torch.ones(SEND[rank]), torch.empty(SEND[other])
    if rank == 0:
        dist.send(mine, dst=other, tag=3)
        dist.recv(theirs, src=other, tag=4)
    else:
        dist.recv(theirs, src=other, tag=3)
        dist.send(mine, dst=other, tag=4)
    dist.reduce(torch.ones(REDUCE), dst=REDUCE_ROOT)
    gather_list = [torch.empty(GATHER) for _ in range(world)] if rank == GATHER_ROOT else None
    dist.gather(torch.ones(GATHER), gather_list, dst=GATHER_ROOT)
    scatter_list = [torch.ones(SCATTER) * r for r in range(world)] if rank == SCATTER_ROOT else None
    dist.scatter(torch.empty(SCATTER), scatter_list, src=SCATTER_ROOT)
    dist.barrier()
    dist.destroy_process_group()

    if args.expect:
        line = json.dumps({"rank": rank, "world_size": world, "pid": os.getpid(), "step_s": step_s,
                           "step_cpu_s": step_cpu_s, "collectives": expected(rank, args.steps, shapes)})
        fd = os.open(args.expect, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, (line + "\n").encode())  # one write per rank: lines never interleave
        finally:
            os.close(fd)
    return 0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch(args: argparse.Namespace) -> int:
    """Start the ranks as children (no torch in this process) and wait for them."""
    if args.expect and os.path.exists(args.expect):
        os.unlink(args.expect)
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": str(WORLD),
           "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), *sys.argv[1:]],
                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}) for r in range(WORLD)]
    rcs = [p.wait() for p in procs]
    return max(rcs, key=abs)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=20, help="training steps (at least 2)")
    ap.add_argument("--expect", help="append each rank's collectives as a JSON line to this file")
    args = ap.parse_args()
    if args.steps < 2:
        ap.error("--steps must be at least 2 (the second step rebuilds DDP's buckets)")
    return worker(args) if "RANK" in os.environ else launch(args)


if __name__ == "__main__":
    sys.exit(main())

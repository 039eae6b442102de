"""A process's place in a distributed job as its launcher wrote it into the environment (torchrun, mpirun, Slurm
wrappers set `RANK`/`WORLD_SIZE`, often `LOCAL_RANK`): the fallback when no runtime probe saw the rank."""

from __future__ import annotations

from collections.abc import Mapping

import psutil

from aiflame.core.raw import RawEvent

RUNTIME = "env"
MAX_WORLD = 1 << 20
# environment variable -> the RawEvent arg it becomes
VARIABLES = {"RANK": "rank", "WORLD_SIZE": "world_size", "LOCAL_RANK": "local_rank",
             "LOCAL_WORLD_SIZE": "local_world_size"}


def rank_args(environ: Mapping[str, str]) -> dict[str, int]:
    """The rank variables found in a process's environment, as RawEvent args. Values that are not small
    non-negative integers are ignored; a rank without a world size it fits is dropped, so a stray `RANK=7`
    never places a process."""
    out: dict[str, int] = {}
    for key, name in VARIABLES.items():
        value = environ.get(key)
        if value is None or not (value.isascii() and value.isdigit()) or len(value) > 8:
            continue
        out[name] = int(value)
    for rank, size in (("rank", "world_size"), ("local_rank", "local_world_size")):
        if rank in out and not 0 <= out[rank] < out.get(size, 0) <= MAX_WORLD:
            out.pop(rank)
            out.pop(size, None)
    if "rank" not in out:
        out.pop("world_size", None)
    return out


def rank_event(pid: int, time_ns: int) -> RawEvent | None:
    """A "meta" event with the process's rank and world size from its environment, None when it has none (or
    is gone, or not ours to read)."""
    try:
        args = rank_args(psutil.Process(pid).environ())
    except psutil.Error:
        return None
    if "rank" not in args:
        return None
    return RawEvent(RUNTIME, "environ", "meta", pid, pid, time_ns, args=args)

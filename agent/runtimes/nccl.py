"""NCCL: collectives and point-to-point calls (count, datatype, bytes, op, root or peer, communicator, stream),
communicator creation and destruction, and groups.

Ranks: a collective passes only its communicator, so return probes on the communicator constructors read the
handle NCCL wrote through their `ncclComm_t *` argument, and each later call on that handle gets the rank and
world size it was created with. A process attached to after its communicators were made learns them from
ncclCommUserRank/ncclCommCount if it calls them.

"bytes" is count × datatype size: the buffer the call's count argument describes (the whole buffer for
AllReduce, Broadcast, Reduce; this rank's contribution for AllGather; this rank's result for ReduceScatter; one
peer's block for AllToAll, Gather, Scatter; the message for Send/Recv). "total_bytes", when the world size is
known, is the largest buffer the call touches on this rank (count × size × world size for AllGather's output,
ReduceScatter's input, AllToAll's send buffer, Gather and Scatter at the root).

Every `nccl*` symbol is a weak alias of `pnccl*` at the same address: either name finds the same probe.
ncclBcast calls ncclBroadcast through the PLT (NCCL 2.32), so a Broadcast made inside a Bcast is dropped.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

from aiflame.agent.runtimes.base import (
    ARG0,
    ARG1,
    ARG2,
    ARG3,
    ARG4,
    ARG5,
    DEREF3,
    SP,
    Call,
    Deref,
    Library,
    ProbeSpec,
    Runtime,
    TargetMemory,
    drop_pid,
)
from aiflame.core.raw import GpuCode, RawEvent

RUNTIME = "nccl"
DTYPES: dict[int, tuple[str, int]] = {
    0: ("int8", 1), 1: ("uint8", 1), 2: ("int32", 4), 3: ("uint32", 4), 4: ("int64", 8), 5: ("uint64", 8),
    6: ("float16", 2), 7: ("float32", 4), 8: ("float64", 8), 9: ("bfloat16", 2), 10: ("float8e4m3", 1),
    11: ("float8e5m2", 1),
}
OPS = {0: "sum", 1: "prod", 2: "max", 3: "min", 4: "avg"}  # >= 5: made by ncclRedOpCreatePreMulSum
NCCL_SUCCESS, NCCL_IN_PROGRESS = 0, 7  # in progress: a non-blocking communicator, valid but not yet ready
CONFIG_MAGIC = 0xCAFEBEEF
CONFIG_NAME_OFFSET = 48  # ncclConfig_t.commName (offsetof in NCCL 2.32); a config too old to have it is shorter
MAX_INIT_ALL = 1024  # communicators read back from ncclCommInitAll's array
STACK0, STACK1, STACK2 = 6, 7, 8  # argument slots past the registers: the 7th-9th integer arguments, at SP+8...
_STACK_ARGS = (Deref(SP, 8), Deref(SP, 16), Deref(SP, 24))


@dataclass(frozen=True, slots=True)
class Layout:
    """Where a collective's arguments are: register index 0-5, or STACK0-STACK2; -1 when it has none."""

    name: str  # the event's call name (Config variants report their plain name, with a "config" arg)
    count: int
    dtype: int
    comm: int
    stream: int
    op: int = -1
    root: int = -1
    peer: int = -1
    config: int = -1
    scale: bool = False  # total_bytes = bytes × world size


def _collectives() -> dict[str, Layout]:
    def reduce_all(name: str, scale: bool = False) -> Layout:  # (send, recv, count, dtype, op, comm, stream)
        return Layout(name, count=ARG2, dtype=ARG3, op=ARG4, comm=ARG5, stream=STACK0, scale=scale)

    def gather_all(name: str) -> Layout:  # (send, recv, count, dtype, comm, stream)
        return Layout(name, count=ARG2, dtype=ARG3, comm=ARG4, stream=ARG5, scale=True)

    def rooted(name: str, scale: bool = False) -> Layout:  # (send, recv, count, dtype, root, comm, stream)
        return Layout(name, count=ARG2, dtype=ARG3, root=ARG4, comm=ARG5, stream=STACK0, scale=scale)

    def p2p(name: str) -> Layout:  # (buf, count, dtype, peer, comm, stream)
        return Layout(name, count=ARG1, dtype=ARG2, peer=ARG3, comm=ARG4, stream=ARG5)

    plain = [
        reduce_all("ncclAllReduce"), reduce_all("ncclReduceScatter", scale=True),
        gather_all("ncclAllGather"), gather_all("ncclAlltoAll"),
        rooted("ncclBroadcast"), rooted("ncclGather", scale=True), rooted("ncclScatter", scale=True),
        # (send, recv, count, dtype, op, root, comm, stream): comm and stream on the stack
        Layout("ncclReduce", count=ARG2, dtype=ARG3, op=ARG4, root=ARG5, comm=STACK0, stream=STACK1),
        # (buf, count, dtype, root, comm, stream): the deprecated in-place broadcast
        Layout("ncclBcast", count=ARG1, dtype=ARG2, root=ARG3, comm=ARG4, stream=ARG5),
        p2p("ncclSend"), p2p("ncclRecv"),
    ]
    out = {lay.name: lay for lay in plain}
    # NCCL >= 2.32: nccl<X>Config(<X>'s arguments..., const ncclCollConfig_t *config), config after stream
    next_slot = {ARG5: STACK0, STACK0: STACK1, STACK1: STACK2}
    for lay in plain:
        if lay.name not in ("ncclBcast", "ncclSend", "ncclRecv"):
            out[lay.name + "Config"] = replace(lay, config=next_slot[lay.stream])
    return out


COLLECTIVES = _collectives()


def _spec(call: str, **kw: object) -> ProbeSpec:
    return ProbeSpec((call, "p" + call), call, **kw)  # type: ignore[arg-type]


SPECS = [
    *(_spec(c, ret=True, derefs=_STACK_ARGS) for c in COLLECTIVES),
    _spec("ncclGroupStart", ret=True, stack=False),
    _spec("ncclGroupEnd", ret=True, stack=False),
    # (ncclComm_t *comm, int nranks, ncclUniqueId id, int rank): the 128-byte id is passed by value, so in
    # memory (SysV: aggregates over 16 bytes), at SP+8; rank is then the third integer register.
    _spec("ncclCommInitRank", ret=True, out_arg=ARG0, derefs=(Deref(SP, 8),)),
    # (comm*, nranks, id, rank, ncclConfig_t *config): config in the fourth register
    _spec("ncclCommInitRankConfig", ret=True, out_arg=ARG0, string=DEREF3,
          derefs=(Deref(SP, 8), Deref(ARG3, 0), Deref(ARG3, 8), Deref(ARG3, CONFIG_NAME_OFFSET))),
    # (comm*, nranks, myrank, nId, ncclUniqueId *commIds, config)
    _spec("ncclCommInitRankScalable", ret=True, out_arg=ARG0, derefs=(Deref(ARG4, 0),)),
    # (ncclComm_t *comms, int ndev, const int *devlist): one process holds every rank
    _spec("ncclCommInitAll", ret=True, out_arg=ARG0),
    # (comm, color, key, ncclComm_t *newcomm, config)
    _spec("ncclCommSplit", ret=True, out_arg=ARG3),
    _spec("ncclCommDestroy", ret=True),
    _spec("ncclCommAbort", ret=True),
    # (comm, int *out): how a process attached to late learns its communicators
    _spec("ncclCommUserRank", ret=True, stack=False, out_arg=ARG1),
    _spec("ncclCommCount", ret=True, stack=False, out_arg=ARG1),
]

_INITS = ("ncclCommInitRank", "ncclCommInitRankConfig", "ncclCommInitRankScalable")


def _i64(v: int) -> int:
    """A value as the capture stores it (sint64): garbage above 2^63 wraps instead of failing the write."""
    v &= (1 << 64) - 1
    return v - (1 << 64) if v >> 63 else v


def _i32(v: int | None) -> int | None:
    if v is None:
        return None
    v &= 0xFFFFFFFF
    return v - (1 << 32) if v >> 31 else v


def _ok(ret: int | None) -> bool:
    return ret is not None and _i32(ret) in (NCCL_SUCCESS, NCCL_IN_PROGRESS)


def _event(call: Call, kind: str, name: str, args: dict[str, int], strs: dict[str, str] | None = None) -> RawEvent:
    ev = call.event(RUNTIME, kind, name)
    ev.args = {k: _i64(v) for k, v in args.items()}
    if strs:
        ev.strs.update(strs)
    return ev


class NcclRuntime(Runtime):
    name: ClassVar[str] = RUNTIME

    def __init__(self) -> None:
        self._comms: dict[tuple[int, int], tuple[int, int]] = {}  # (pid, comm) -> (rank, world size); -1 unknown
        self._group_depth: dict[tuple[int, int], int] = {}  # (pid, tid) -> ncclGroupStart nesting

    def specs(self) -> list[ProbeSpec]:
        return list(SPECS)

    def wants(self, lib: Library) -> bool:
        return lib.basename.startswith("libnccl.so")

    def forget(self, pid: int) -> None:
        drop_pid(self._comms, pid)
        drop_pid(self._group_depth, pid)

    def decode(self, call: Call, mem: TargetMemory) -> list[RawEvent | GpuCode]:
        name = call.spec.call
        lay = COLLECTIVES.get(name)
        if lay is not None:
            return self._collective(call, lay)
        if name in ("ncclGroupStart", "ncclGroupEnd"):
            return self._group(call, name)
        if name in _INITS:
            return [self._init_rank(call, name, mem)]
        if name == "ncclCommInitAll":
            return [self._init_all(call, mem)]
        if name == "ncclCommSplit":
            return [self._split(call)]
        if name in ("ncclCommDestroy", "ncclCommAbort"):
            comm = call.arg(ARG0)
            known = self._comms.pop((call.pid, comm), None)
            args = {"comm": comm, **self._ret(call)}
            if known is not None:
                args.update(self._place(known))
            return [_event(call, "meta", name, args)]
        if name in ("ncclCommUserRank", "ncclCommCount"):
            self._learn(call, name)
            return []
        return []

    # --- collectives ------------------------------------------------------------------------------------------

    @staticmethod
    def _slot(call: Call, slot: int) -> int | None:
        if slot < 0:
            return None
        if slot < STACK0:
            return call.arg(slot)
        return call.deref(slot - STACK0)

    def _collective(self, call: Call, lay: Layout) -> list[RawEvent | GpuCode]:
        if lay.name == "ncclBroadcast" and call.parent == "ncclBcast":
            return []  # the Bcast around it is the event
        args: dict[str, int] = {}
        strs: dict[str, str] = {}
        count = self._slot(call, lay.count) or 0
        dtype = _i32(self._slot(call, lay.dtype))
        args["count"] = count
        if dtype is not None:
            args["dtype"] = dtype
            known = DTYPES.get(dtype)
            strs["dtype"] = known[0] if known else f"dtype {dtype}"
            if known:
                args["bytes"] = count * known[1]
        op = _i32(self._slot(call, lay.op))
        if op is not None:
            args["op"] = op
            strs["op"] = OPS.get(op, f"custom {op}")
        for key, slot in (("root", lay.root), ("peer", lay.peer)):
            v = _i32(self._slot(call, slot))
            if v is not None:
                args[key] = v
        comm = self._slot(call, lay.comm)
        if comm is not None:
            args["comm"] = comm
        stream = self._slot(call, lay.stream)
        if stream is not None:
            args["stream"] = stream
        config = self._slot(call, lay.config)
        if config is not None:
            args["config"] = config
        place = self._comms.get((call.pid, comm)) if comm is not None else None
        if place is not None:
            args.update(self._place(place))
            if lay.scale and place[1] > 0 and "bytes" in args:
                args["total_bytes"] = args["bytes"] * place[1]
        if self._group_depth.get((call.pid, call.tid), 0) > 0:
            args["grouped"] = 1  # enqueued now, launched by the ncclGroupEnd that closes the group
        args.update(self._ret(call))
        return [_event(call, "collective", lay.name, args, strs)]

    def _group(self, call: Call, name: str) -> list[RawEvent | GpuCode]:
        key = (call.pid, call.tid)
        depth = self._group_depth.get(key, 0)
        depth = depth + 1 if name == "ncclGroupStart" else max(depth - 1, 0)
        self._group_depth[key] = depth
        return [_event(call, "meta", name, {"depth": depth, **self._ret(call)})]

    # --- communicators ----------------------------------------------------------------------------------------

    def _init_rank(self, call: Call, name: str, mem: TargetMemory) -> RawEvent:
        nranks = _i32(call.args[ARG1]) or 0
        rank = _i32(call.args[ARG2]) or 0
        args = {"rank": rank, "nranks": nranks, **self._ret(call)}
        strs: dict[str, str] = {}
        uid = call.deref(0)
        if uid is not None:
            strs["comm_id"] = f"{uid:016x}"  # the unique id's first 8 bytes (a random magic): same on every rank
        if name == "ncclCommInitRankConfig":
            args["config"] = call.arg(ARG3)
            size, magic = call.deref(1), call.deref(2)
            name_ptr = call.deref(3)
            if (size is not None and magic is not None and size >= CONFIG_NAME_OFFSET + 8
                    and magic & 0xFFFFFFFF == CONFIG_MAGIC and name_ptr):
                # the probe's read fails on a page not yet resident: read it from user space then
                comm_name = call.string.decode("utf-8", "replace") if call.string else mem.read_cstr(
                    call.pid, name_ptr, 256)
                if comm_name:
                    strs["comm_name"] = comm_name
        if _ok(call.ret) and call.out:
            # A failed init leaves *comm as the caller had it: only a success names a communicator.
            args["comm"] = call.out
            args["world_size"] = nranks
            self._comms[(call.pid, call.out)] = (rank, nranks)
        return _event(call, "meta", name, args, strs)

    def _init_all(self, call: Call, mem: TargetMemory) -> RawEvent:
        ndev = _i32(call.args[ARG1]) or 0
        args = {"nranks": ndev, "devlist": call.arg(ARG2), **self._ret(call)}
        if _ok(call.ret) and 0 < ndev <= MAX_INIT_ALL:
            data = mem.read(call.pid, call.arg(ARG0), 8 * ndev)
            handles = [int.from_bytes(data[i:i + 8], "little") for i in range(0, len(data), 8)] if data else []
            if not handles and call.out:
                handles = [call.out]  # the array is gone: at least comms[0], read at return
            for rank, comm in enumerate(handles):
                if comm:
                    self._comms[(call.pid, comm)] = (rank, ndev)
            if handles:
                args["comm"] = handles[0]
        return _event(call, "meta", "ncclCommInitAll", args)

    def _split(self, call: Call) -> RawEvent:
        parent = call.arg(ARG0)
        args = {"comm": parent, "color": _i32(call.args[ARG1]) or 0, "key": _i32(call.args[ARG2]) or 0,
                **self._ret(call)}
        place = self._comms.get((call.pid, parent))
        if place is not None:
            args.update(self._place(place))
        if _ok(call.ret) and call.out:
            # The new rank and size are decided inside NCCL (by color and key across ranks): unknown here until
            # the process asks ncclCommUserRank/ncclCommCount.
            args["new_comm"] = call.out
            self._comms[(call.pid, call.out)] = (-1, -1)
        return _event(call, "meta", "ncclCommSplit", args)

    def _learn(self, call: Call, name: str) -> None:
        value = _i32(call.out)
        if not _ok(call.ret) or value is None or value < 0:
            return
        key = (call.pid, call.arg(ARG0))
        rank, size = self._comms.get(key, (-1, -1))
        self._comms[key] = (value, size) if name == "ncclCommUserRank" else (rank, value)

    @staticmethod
    def _place(place: tuple[int, int]) -> dict[str, int]:
        rank, size = place
        out: dict[str, int] = {}
        if rank >= 0:
            out["rank"] = rank
        if size > 0:
            out["world_size"] = size
        return out

    @staticmethod
    def _ret(call: Call) -> dict[str, int]:
        r = _i32(call.ret)
        return {} if r is None else {"ret": r}

"""gloo collectives in PyTorch's CPU library (libtorch_cpu.so): one event per collective a rank makes, with its
type, bytes, root or peer, start and end, and the rank and world size of the process.

Where they are observed (libtorch_cpu keeps its .symtab, so local symbols are probed too):
- `gloo::Context::Context(rank, size, base)`: the rank and world size of each process group ("meta" events).
- The algorithm entries (`gloo::allreduce(const AllreduceOptions&)`, allgather, allgatherv, broadcast, alltoall,
  alltoallv, reduce, gather, scatter, barrier) on the process group's worker threads, entry to return. Their
  options structs are read at fixed offsets (OPTIONS below): build-specific, so every event is checked (context
  pointer, element size, counts, root) and says `strs["layout"] = "unverified: ..."` when a check fails.
- `c10d::ProcessGroupGloo::send/recv(tensors, peer, tag)`: point-to-point posts. They return a Work through a
  hidden pointer (rdi), so `this` is in rsi and the peer and tag in the 4th and 5th registers. Their completion
  is `SendWork::wait`/`RecvWork::wait`, reported as "sync" events `send_wait`/`recv_wait`.
- The transport underneath all of them, `gloo::transport::tcp::UnboundBuffer::send/recv(peer, slot, offset,
  nbytes)`. Calls made inside a probed collective or send/recv are folded into it (`wire_sent`, `wire_recv`
  bytes; a send/recv takes its `bytes` from them), so summaries count each collective once; transport calls
  outside any of them become "other" events `transport_send`/`transport_recv`.

`bytes` per collective: allreduce, broadcast, reduce: the buffer; allgather, allgatherv, gather: this rank's
input; scatter: this rank's output; alltoall, alltoallv: what this rank sends (its whole input); send, recv: the
message; barrier: 0.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import ClassVar

from aiflame.agent.runtimes.base import (
    ARG0,
    ARG1,
    ARG2,
    ARG3,
    ARG4,
    DEREF1,
    Call,
    Deref,
    Library,
    ProbeSpec,
    Runtime,
    TargetMemory,
    drop_pid,
)
from aiflame.core.raw import GpuCode, RawEvent

RUNTIME = "gloo"
U64_MAX = (1 << 64) - 1
ELEMENT_SIZES = frozenset({1, 2, 4, 8, 16})
MAX_ELEMENTS = 1 << 40  # more is a misread, not a tensor
MAX_WORLD = 1 << 20
MAX_PENDING_P2P = 4096  # posted sends/recvs kept per capture until their wait

CONTEXT_CALL = "gloo::Context"
PG_SEND, PG_RECV = "c10d::ProcessGroupGloo::send", "c10d::ProcessGroupGloo::recv"
SEND_WAIT, RECV_WAIT = "c10d::ProcessGroupGloo::SendWork::wait", "c10d::ProcessGroupGloo::RecvWork::wait"
T_SEND, T_RECV = "gloo::transport::send", "gloo::transport::recv"


@dataclass(frozen=True, slots=True)
class Options:
    """Where one algorithm's options struct keeps what the event needs. `reads` are the probe's derefs, by name,
    in order; the first is always the context pointer (`std::shared_ptr<Context>` at +0). `bytes` names the rule
    that turns them into the event's byte count."""

    call: str
    symbol: str
    reads: tuple[tuple[str, Deref], ...]
    bytes: str  # "elements" (elements x elsize), "in_size", "out_size", "out_per_rank" (out_size / size), "none"

    def spec(self) -> ProbeSpec:
        return ProbeSpec((self.symbol,), f"gloo::{self.call}", ret=True, derefs=tuple(d for _, d in self.reads))


_CTX = ("context", Deref(ARG0, 0))


def _buffer_size(ptr_name: str, offset: int) -> tuple[tuple[str, Deref], tuple[str, Deref]]:
    """A `std::unique_ptr<transport::UnboundBuffer>` at `offset`, and that buffer's size (UnboundBuffer: vtable,
    ptr, size at +16). Read second, so the chain's source is DEREF1."""
    return (ptr_name, Deref(ARG0, offset)), (ptr_name.strip("_") + "_size", Deref(DEREF1, 16))


# Offsets in the gloo vendored by PyTorch 2.13 (x86-64), read from the headers and checked against the
# disassembly of each algorithm and a real 2-rank run (tags count up 0, 1, 2... across all of them).
OPTIONS = (
    # detail::AllreduceOptionsImpl: context, timeout, algorithm, in (vector), out (vector), elements, elementSize
    Options("allreduce", "_ZN4gloo9allreduceERKNS_16AllreduceOptionsE",
            (_CTX, ("elements", Deref(ARG0, 80)), ("elsize", Deref(ARG0, 88))), "elements"),
    # context, in, out, elementSize, tag, timeout
    Options("allgather", "_ZN4gloo9allgatherERNS_16AllgatherOptionsE",
            (_CTX, *_buffer_size("_out", 24), ("elsize", Deref(ARG0, 32))), "out_per_rank"),
    # context, in, out, counts (vector), elementSize, tag
    Options("allgatherv", "_ZN4gloo10allgathervERNS_17AllgathervOptionsE",
            (_CTX, *_buffer_size("_in", 16), ("elsize", Deref(ARG0, 56))), "in_size"),
    # context, in, out, elements, elementSize, root (int) | tag (u32)
    Options("broadcast", "_ZN4gloo9broadcastERNS_16BroadcastOptionsE",
            (_CTX, ("elements", Deref(ARG0, 32)), ("elsize", Deref(ARG0, 40)), ("root", Deref(ARG0, 48))),
            "elements"),
    # context, in, out, elementSize, tag
    Options("alltoall", "_ZN4gloo8alltoallERNS_15AlltoallOptionsE",
            (_CTX, *_buffer_size("_in", 16), ("elsize", Deref(ARG0, 32))), "in_size"),
    # context, in, out, in/out offsets and lengths per rank (4 vectors), elementSize, tag
    Options("alltoallv", "_ZN4gloo9alltoallvERNS_16AlltoallvOptionsE",
            (_CTX, *_buffer_size("_in", 16), ("elsize", Deref(ARG0, 128))), "in_size"),
    # context, in, out, elements, elementSize, root, reduce (std::function), tag
    Options("reduce", "_ZN4gloo6reduceERNS_13ReduceOptionsE",
            (_CTX, ("elements", Deref(ARG0, 32)), ("elsize", Deref(ARG0, 40)), ("root", Deref(ARG0, 48))),
            "elements"),
    # context, in, out, elementSize, root | tag
    Options("gather", "_ZN4gloo6gatherERNS_13GatherOptionsE",
            (_CTX, *_buffer_size("_in", 16), ("root", Deref(ARG0, 40))), "in_size"),
    # context, in (vector), out, elementSize, root | tag
    Options("scatter", "_ZN4gloo7scatterERNS_14ScatterOptionsE",
            (_CTX, *_buffer_size("_out", 40), ("root", Deref(ARG0, 56))), "out_size"),
    # context, buffer, tag
    Options("barrier", "_ZN4gloo7barrierERNS_14BarrierOptionsE", (_CTX,), "none"),
)
BY_CALL = {o.spec().call: o for o in OPTIONS}

P2P_SUFFIX = "ERSt6vectorIN2at6TensorESaIS3_EEii"
WAIT_SUFFIX = "4waitENSt6chrono8durationIlSt5ratioILl1ELl1000EEEE"
SPECS = [
    ProbeSpec(("_ZN4gloo7ContextC2Eiii", "_ZN4gloo7ContextC1Eiii"), CONTEXT_CALL, stack=False),
    *(o.spec() for o in OPTIONS),
    # (Work return slot, this, tensors, peer, tag): the Work pointer is read through the slot at return
    ProbeSpec((f"_ZN4c10d16ProcessGroupGloo4send{P2P_SUFFIX}",), PG_SEND, ret=True, out_arg=ARG0),
    ProbeSpec((f"_ZN4c10d16ProcessGroupGloo4recv{P2P_SUFFIX}",), PG_RECV, ret=True, out_arg=ARG0),
    ProbeSpec((f"_ZN4c10d16ProcessGroupGloo8SendWork{WAIT_SUFFIX}",), SEND_WAIT, ret=True),
    ProbeSpec((f"_ZN4c10d16ProcessGroupGloo8RecvWork{WAIT_SUFFIX}",), RECV_WAIT, ret=True),
    # (this, peer, slot, offset, nbytes): nbytes = SIZE_MAX means "the rest of the buffer" (size at this+16)
    ProbeSpec(("_ZN4gloo9transport3tcp13UnboundBuffer4sendEimmm",), T_SEND, stack=False, derefs=(Deref(ARG0, 16),)),
    ProbeSpec(("_ZN4gloo9transport3tcp13UnboundBuffer4recvEimmm",), T_RECV, stack=False, derefs=(Deref(ARG0, 16),)),
]
PARENTS = frozenset({*BY_CALL, PG_SEND, PG_RECV})  # calls that absorb the transport calls made inside them


def _s32(v: int) -> int:
    v &= 0xFFFFFFFF
    return v - (1 << 32) if v >> 31 else v


@dataclass(slots=True)
class Wire:
    """Transport traffic inside one open collective or send/recv."""

    sent: int = 0
    recv: int = 0
    sends: int = 0
    recvs: int = 0
    unknown: int = 0  # transport calls whose size could not be read


@dataclass(frozen=True, slots=True)
class Posted:
    """A send/recv waiting for its wait()."""

    peer: int
    tag: int
    nbytes: int | None


class GlooRuntime(Runtime):
    """Decodes gloo's collectives, point-to-point calls and contexts. Keeps per-process state: the contexts seen
    (rank and size), the transport traffic of open calls, and posted sends/recvs until their wait."""

    name: ClassVar[str] = RUNTIME

    def __init__(self) -> None:
        self._contexts: dict[tuple[int, int], tuple[int, int]] = {}  # (pid, Context*) -> (rank, size)
        self._process: dict[int, tuple[int, int]] = {}  # pid -> (rank, size) of its first context
        self._wire: dict[tuple[int, int], Wire] = {}  # (pid, tid) -> traffic of the open parent call
        self._posted: dict[tuple[int, int], Posted] = {}  # (pid, Work*) -> its send/recv
        self.unverified: Counter[str] = Counter()  # events whose layout checks failed, by call

    def specs(self) -> list[ProbeSpec]:
        return list(SPECS)

    def wants(self, lib: Library) -> bool:
        return lib.basename.startswith("libtorch_cpu")

    def forget(self, pid: int) -> None:
        drop_pid(self._contexts, pid)
        self._process.pop(pid, None)
        drop_pid(self._wire, pid)
        drop_pid(self._posted, pid)

    # --- decoding ---------------------------------------------------------------------------------------------

    def decode(self, call: Call, mem: TargetMemory) -> list[RawEvent | GpuCode]:
        name = call.spec.call
        if name == CONTEXT_CALL:
            return [self._context(call)]
        if name in (T_SEND, T_RECV):
            return self._transport(call)
        if name in (PG_SEND, PG_RECV):
            return [self._p2p(call)]
        if name in (SEND_WAIT, RECV_WAIT):
            return [self._wait(call)]
        opts = BY_CALL.get(name)
        return [self._collective(call, opts, mem)] if opts else []

    def _context(self, call: Call) -> RawEvent:
        rank, size = call.arg(ARG1, 32, signed=True), call.arg(ARG2, 32, signed=True)
        ctx = call.arg(ARG0)
        ev = call.event(RUNTIME, "meta", "context", rank=rank, world_size=size, context=ctx,
                        base=call.arg(ARG3, 32, signed=True))
        if not 0 <= rank < size <= MAX_WORLD:
            self._flag(ev, [f"rank {rank} / size {size} is not a rank of a group"])
            return ev
        self._contexts[(call.pid, ctx)] = (rank, size)
        self._process.setdefault(call.pid, (rank, size))
        return ev

    def _transport(self, call: Call) -> list[RawEvent | GpuCode]:
        send = call.spec.call == T_SEND
        peer, offset, nbytes = call.arg(ARG1, 32, signed=True), call.arg(ARG3), call.arg(ARG4)
        if nbytes == U64_MAX:  # the default: the buffer from `offset` to its end
            size = call.deref(0)
            nbytes = size - offset if size is not None and size >= offset else -1
        if call.parent in PARENTS:
            w = self._wire.setdefault((call.pid, call.tid), Wire())
            if nbytes < 0:
                w.unknown += 1
            elif send:
                w.sent, w.sends = w.sent + nbytes, w.sends + 1
            else:
                w.recv, w.recvs = w.recv + nbytes, w.recvs + 1
            return []
        ev = call.event(RUNTIME, "other", "transport_send" if send else "transport_recv", peer=peer,
                        slot=call.arg(ARG2), offset=offset)
        if nbytes >= 0:
            ev.args["bytes"] = nbytes
        else:
            self._flag(ev, ["buffer size unreadable"])
        self._place(ev, call.pid)
        return [ev]

    def _take_wire(self, call: Call) -> Wire | None:
        return self._wire.pop((call.pid, call.tid), None)

    def _p2p(self, call: Call) -> RawEvent:
        send = call.spec.call == PG_SEND
        peer, tag = call.arg(ARG3, 32, signed=True), call.arg(ARG4, 32, signed=True)
        ev = call.event(RUNTIME, "collective", "send" if send else "recv", peer=peer, tag=tag)
        w = self._take_wire(call)
        nbytes = None if w is None or w.unknown else (w.sent if send else w.recv)
        problems = []
        if nbytes is None:
            problems.append("no transport call seen inside" if w is None else "transport buffer size unreadable")
        else:
            ev.args["bytes"] = nbytes
        proc = self._process.get(call.pid)
        if peer < 0 or (proc is not None and peer >= proc[1]):
            problems.append(f"peer {peer} outside the group")
        if problems:
            self._flag(ev, problems)
        if call.out:
            ev.args["work"] = call.out
            if len(self._posted) >= MAX_PENDING_P2P:  # never waited for: drop the oldest
                self._posted.pop(next(iter(self._posted)))
            self._posted[(call.pid, call.out)] = Posted(peer, tag, nbytes)
        self._place(ev, call.pid)
        return ev

    def _wait(self, call: Call) -> RawEvent:
        send = call.spec.call == SEND_WAIT
        ev = call.event(RUNTIME, "sync", "send_wait" if send else "recv_wait", work=call.arg(ARG0))
        posted = self._posted.pop((call.pid, call.arg(ARG0)), None)
        if posted is not None:
            ev.args.update(peer=posted.peer, tag=posted.tag)
            if posted.nbytes is not None:
                ev.args["bytes"] = posted.nbytes
        self._place(ev, call.pid)
        return ev

    def _collective(self, call: Call, opts: Options, mem: TargetMemory) -> RawEvent:
        vals: dict[str, int | None] = {n: call.deref(i) for i, (n, _) in enumerate(opts.reads)}
        ev = call.event(RUNTIME, "collective", opts.call)
        problems: list[str] = []
        group = self._group(call.pid, vals["context"], mem, problems)
        size = group[1] if group else 0
        elsize = vals.get("elsize")
        if elsize is not None and elsize not in ELEMENT_SIZES:
            problems.append(f"element size {elsize}")
            elsize = None
        if "root" in vals:
            root = vals["root"]
            if root is None:
                problems.append("root unreadable")
            else:
                ev.args["root"] = _s32(root)
                if not 0 <= ev.args["root"] < (size or MAX_WORLD):
                    problems.append(f"root {ev.args['root']} outside the group")
        nbytes, count = self._bytes(opts, vals, elsize, size, problems)
        if nbytes is not None:
            ev.args["bytes"] = nbytes
        if count is not None:
            ev.args["count"] = count
        if elsize is not None:
            ev.args["elsize"] = elsize
        missing = [n for n, v in vals.items() if v is None and n not in ("_in", "_out", "context", "root")]
        if missing:
            problems.append(f"unreadable {', '.join(missing)}")
        if vals["context"]:
            ev.args["context"] = vals["context"]
        w = self._take_wire(call)
        if w is not None:
            ev.args.update(wire_sent=w.sent, wire_recv=w.recv, wire_sends=w.sends, wire_recvs=w.recvs)
            if w.unknown:
                problems.append(f"{w.unknown} transport buffer sizes unreadable")
        if call.parent in BY_CALL:  # an algorithm run by another one: keep it, but do not count it twice
            ev.kind = "other"
            ev.strs["inside"] = BY_CALL[call.parent].call
        self._place(ev, call.pid, group)
        if problems:
            self._flag(ev, problems)
        return ev

    @staticmethod
    def _bytes(opts: Options, vals: dict[str, int | None], elsize: int | None, size: int,
               problems: list[str]) -> tuple[int | None, int | None]:
        """(bytes, element count) by the op's rule, with count checks."""
        if opts.bytes == "none":
            return 0, None
        if opts.bytes == "elements":
            n = vals["elements"]
            if n is None or elsize is None:
                return None, None
            if n > MAX_ELEMENTS:
                problems.append(f"element count {n}")
                return None, None
            return n * elsize, n
        total = vals[opts.bytes if opts.bytes != "out_per_rank" else "out_size"]
        if total is None or total > MAX_ELEMENTS:
            if total is not None:
                problems.append(f"buffer size {total}")
            return None, None
        if opts.bytes == "out_per_rank":
            if not size:
                return None, None
            if total % size:
                problems.append(f"output of {total} bytes does not split into {size} ranks")
            total //= size
        # alltoall splits its input evenly over the ranks; the others need whole elements
        unit = (elsize or 1) * (size if opts.call == "alltoall" and size else 1)
        if total % unit:
            problems.append(f"buffer of {total} bytes is not whole elements of {elsize}")
        return total, total // elsize if elsize else None

    def _group(self, pid: int, ctx: int | None, mem: TargetMemory, problems: list[str]) -> tuple[int, int] | None:
        """(rank, size) of the op's context: the one seen constructed, else read from the process (attached after
        the process group was made)."""
        if not ctx:
            problems.append("context pointer unreadable")
            return None
        known = self._contexts.get((pid, ctx))
        if known is not None:
            return known
        if any(p == pid for p, _ in self._contexts):
            problems.append(f"context {ctx:#x} is not a gloo::Context seen in this process")
        raw = mem.read_u64(pid, ctx)
        if raw is None:
            problems.append(f"context {ctx:#x} unreadable")
            return None
        rank, size = _s32(raw), _s32(raw >> 32)
        if not 0 <= rank < size <= MAX_WORLD:
            problems.append(f"context {ctx:#x} holds rank {rank} / size {size}")
            return None
        self._contexts[(pid, ctx)] = (rank, size)
        self._process.setdefault(pid, (rank, size))
        return rank, size

    def _place(self, ev: RawEvent, pid: int, group: tuple[int, int] | None = None) -> None:
        """The process's rank and world size; the op's own when it ran in another group (a subgroup)."""
        proc = self._process.get(pid)
        if proc is not None:
            ev.args["rank"], ev.args["world_size"] = proc
        if group is not None and group != proc:
            ev.args["group_rank"], ev.args["group_size"] = group
            if proc is None:
                ev.args["rank"], ev.args["world_size"] = group

    def _flag(self, ev: RawEvent, problems: list[str]) -> None:
        ev.strs["layout"] = "unverified: " + "; ".join(problems)
        self.unverified[ev.call] += 1

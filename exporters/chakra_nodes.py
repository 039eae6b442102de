"""The nodes of Chakra execution traces, per rank, built from a capture's timed events and CPU samples, holding
only what ASTRA-sim runs (see shared/facts/chakra.md); exporters/chakra.py encodes and writes them.

What becomes a node, per rank:
- a collective: COMM_COLL (`comm_type`, `comm_size`, `comm_priority`, `pg_name`); those the simulator cannot run
  (reduce, gather, scatter, barrier) become the point-to-point messages they are made of, COMM_SEND/COMM_RECV
  to or from the root (rank 0 for a barrier: gather, then release), tagged `DECOMPOSED_TAG + n` for the n-th
  collective of the rank, so the peers' halves meet;
- a send or recv: COMM_SEND/COMM_RECV (`comm_src`, `comm_dst`, `comm_tag`, `comm_size`), ending at its wait when
  one was seen; NCCL's carry no tag, so theirs is `P2P_TAG + n` for the n-th message between the two ranks;
- a kernel launch: a GPU COMP node on its stream (duration from `gpu_ns` when the capture has it, else 0);
  a host↔device copy: MEM_LOAD (to the device) or MEM_STORE (to the host) with `tensor_size`; a device sync:
  a zero-length CPU COMP node that waits for its stream;
- the time between those on the rank's CPU: CPU COMP nodes (`is_cpu_op` true), one per interval between the
  starts of the calls above, named after the frame most of that interval's samples were in.

Dependencies, all pointing back in time, so the trace is a DAG whose ids grow along every edge: control
dependencies chain each thread's (and each stream's) nodes in program order and a process group's collectives
in issue order (the order every rank agrees on); the CPU intervals form one chain; a call issued by the host
depends on the CPU interval before it (the compute that produced its buffer), and a CPU interval depends on the
communication and copies that had completed before it began (the capture shows it did not need to wait longer).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from aiflame.core.model import EventKind, Frame, FrameKind, Profile, TraceEvent

from .base import ExportError, NothingToExport

MIN_CPU_NS = 1000  # CPU intervals shorter than a microsecond are not worth a node
DECOMPOSED_TAG = 1 << 30
P2P_TAG = 1 << 29

# Chakra's NodeType and CollectiveCommType values (et_def.proto), so building needs no protobuf import.
METADATA, MEM_LOAD, MEM_STORE, COMP, COMM_SEND, COMM_RECV, COMM_COLL = 1, 2, 3, 4, 5, 6, 7
ALL_REDUCE, REDUCE, ALL_GATHER, GATHER, SCATTER, BROADCAST, ALL_TO_ALL, REDUCE_SCATTER = 0, 1, 2, 3, 4, 5, 6, 7
NODE_TYPE_NAMES = {MEM_LOAD: "MEM_LOAD", MEM_STORE: "MEM_STORE", COMP: "COMP", COMM_SEND: "COMM_SEND",
                   COMM_RECV: "COMM_RECV", COMM_COLL: "COMM_COLL"}

# Runtime call -> the collective ASTRA-sim simulates; the size rule is the converter's: this rank's input.
COLLECTIVES: dict[str, int] = {
    "allreduce": ALL_REDUCE, "allgather": ALL_GATHER, "allgatherv": ALL_GATHER, "broadcast": BROADCAST,
    "alltoall": ALL_TO_ALL, "alltoallv": ALL_TO_ALL,
    "ncclAllReduce": ALL_REDUCE, "ncclAllGather": ALL_GATHER, "ncclBroadcast": BROADCAST, "ncclBcast": BROADCAST,
    "ncclAlltoAll": ALL_TO_ALL, "ncclReduceScatter": REDUCE_SCATTER,
}
USES_TOTAL = frozenset({"ncclAlltoAll", "ncclReduceScatter"})  # their `bytes` is one block; the input is total
# Collectives the simulator aborts on, as the messages they are made of: (shape, root when the call has none).
DECOMPOSED: dict[str, str] = {
    "reduce": "to_root", "gather": "to_root", "ncclReduce": "to_root", "ncclGather": "to_root",
    "scatter": "from_root", "ncclScatter": "from_root", "barrier": "barrier",
}
SENDS, RECVS = frozenset({"send", "ncclSend"}), frozenset({"recv", "ncclRecv"})
P2P_WAITS = frozenset({"send_wait", "recv_wait"})  # gloo: the completion of a posted send/recv
TO_DEVICE, TO_HOST = frozenset({"HtoD"}), frozenset({"DtoH"})
SYNC_COPIES = frozenset({"cudaMemcpy", "cudaMemset"})  # the host waits for these


class ChakraError(ExportError):
    """The capture cannot become a Chakra trace, or a `.et` file is malformed; one line."""


class NoCommunication(ChakraError, NothingToExport):
    """The capture has no collective, launch or copy: nothing for a trace."""


@dataclass(slots=True)
class EtNode:
    """One Chakra node before encoding. `attrs` values are (protobuf field, value): the typed slot the consumers
    read, e.g. ("int64_val", 4096)."""

    id: int
    name: str
    type: int
    start_ns: int
    duration_ns: int
    attrs: dict[str, tuple[str, Any]] = field(default_factory=dict)
    ctrl_deps: list[int] = field(default_factory=list)
    data_deps: list[int] = field(default_factory=list)

    @property
    def is_cpu(self) -> bool:
        return bool(self.attrs.get("is_cpu_op", ("", False))[1])


@dataclass(slots=True)
class RankTrace:
    rank: int
    world_size: int
    pids: list[int]
    nodes: list[EtNode]


@dataclass(slots=True)
class ChakraTraces:
    """The traces of every rank in a capture, and what could not be represented exactly."""

    ranks: dict[int, RankTrace]
    warnings: list[str] = field(default_factory=list)


def _int(ev: TraceEvent, key: str, default: int = 0) -> int:
    v = ev.args.get(key, default)
    return int(v) if isinstance(v, int | float) else default


def _call(ev: TraceEvent) -> str:
    return str(ev.args.get("call", ev.name))


def assign_ranks(prof: Profile, warnings: list[str]) -> tuple[dict[int, int], int]:
    """pid -> rank for every pid with communication (or any event), and the world size. Ranks come from the
    events (runtimes or the environment); pids with none get the ranks after the known ones, with a warning."""
    pid_rank: dict[int, int] = {}
    world = 0
    for ev in prof.events:
        if ev.rank >= 0:
            pid_rank.setdefault(ev.pid, ev.rank)
        world = max(world, _int(ev, "world_size"))
    unranked = sorted({ev.pid for ev in prof.events} - pid_rank.keys())
    if unranked:
        nxt = max(pid_rank.values(), default=-1) + 1
        for pid in unranked:
            pid_rank[pid] = nxt
            nxt += 1
        warnings.append(f"no rank known for pid(s) {', '.join(map(str, unranked))}: numbered after the known ranks")
    by_rank: dict[int, list[int]] = defaultdict(list)
    for pid, r in pid_rank.items():
        by_rank[r].append(pid)
    for r, pids in by_rank.items():
        if len(pids) > 1:
            warnings.append(f"rank {r} is held by several processes ({', '.join(map(str, sorted(pids)))}): merged")
    world = max(world, max(pid_rank.values(), default=-1) + 1)
    return pid_rank, world


def dominant_frame(stacks: Iterable[tuple[Frame, ...]]) -> tuple[str, int]:
    """The frame most samples were in, and how many: each sample counts its innermost Python frame, else its
    innermost user-space native frame (kernel, separator and process frames never name compute)."""
    counts: Counter[str] = Counter()
    n = 0
    for stack in stacks:
        n += 1
        pick = next((f for f in reversed(stack) if f.kind == FrameKind.PYTHON), None)
        if pick is None:
            pick = next((f for f in reversed(stack) if f.kind in (FrameKind.NATIVE, FrameKind.NATIVE_CPP)), None)
        if pick is not None:
            counts[f"{pick.name} ({pick.file})" if pick.kind == FrameKind.PYTHON and pick.file else pick.name] += 1
    if not counts:
        return ("cpu" if not n else "[unknown]"), n
    return counts.most_common(1)[0][0], n


@dataclass(slots=True)
class _Op:
    """One thing the rank's host issued, before it becomes nodes."""

    ev: TraceEvent
    end_ns: int


class _RankBuilder:
    def __init__(self, rank: int, world: int, pids: list[int], warnings: list[str]) -> None:
        self.rank, self.world, self.pids, self.warnings = rank, world, pids, warnings
        self.nodes: list[EtNode] = []
        self.last_on_lane: dict[tuple[str, int], int] = {}  # (lane kind, thread or stream) -> node id
        self.last_coll: int | None = None
        self.done_comm: list[tuple[int, int]] = []  # (end ns, node id) not yet waited for by the CPU chain
        self.coll_seq = 0
        self.p2p_seq: Counter[tuple[int, int]] = Counter()
        self.posted: dict[tuple[int, int], int] = {}  # gloo (pid, Work*) -> its send/recv node

    def node(self, name: str, type_: int, start: int, dur: int, **attrs: tuple[str, Any]) -> EtNode:
        n = EtNode(len(self.nodes) + 1, name, type_, start, max(dur, 0), dict(attrs))
        self.nodes.append(n)
        return n

    def chain(self, n: EtNode, lane: tuple[str, int]) -> None:
        prev = self.last_on_lane.get(lane)
        if prev is not None and prev not in n.ctrl_deps:
            n.ctrl_deps.append(prev)
        self.last_on_lane[lane] = n.id

    def build(self, events: list[TraceEvent], samples: list[tuple[int, tuple[Frame, ...]]]) -> list[EtNode]:
        ops = self._ops(events)
        order = sorted(samples, key=lambda s: s[0])
        seg_start = min([*(o.ev.start_ns for o in ops), *(t for t, _ in order[:1])], default=0)
        si = 0
        cpu_prev: int | None = None
        for op in [*ops, None]:
            # the CPU interval before this call (its buffer's producer), or after the last one
            end = op.ev.start_ns if op is not None else max([seg_start, *(t for t, _ in order[-1:])])
            if end - seg_start >= MIN_CPU_NS:
                lo = si
                while si < len(order) and order[si][0] < end:
                    si += 1
                name, n = dominant_frame(st for _, st in order[lo:si])
                seg = self.node(name, COMP, seg_start, end - seg_start, is_cpu_op=("bool_val", True),
                                num_samples=("int64_val", n))
                self._cpu_waits(seg, seg_start)
                self.chain(seg, ("cpu", 0))
                cpu_prev = seg.id
                seg_start = end
            if op is None:
                break
            made = self._op_nodes(op)
            for node in made:
                if cpu_prev is not None and cpu_prev not in node.data_deps:
                    node.data_deps.append(cpu_prev)
            if made and (op.ev.kind == EventKind.SYNC or _call(op.ev) in SYNC_COPIES):
                # the host blocked until it returned: the CPU chain continues after it
                seg_start = max(seg_start, op.end_ns)
                if made[-1].is_cpu:
                    cpu_prev = made[-1].id
        return self.nodes

    def _ops(self, events: list[TraceEvent]) -> list[_Op]:
        """The rank's events that become nodes, by start, with gloo's send/recv ending at their wait."""
        waits: dict[tuple[int, int], TraceEvent] = {}
        for ev in events:
            if _call(ev) in P2P_WAITS and _int(ev, "work"):
                waits[(ev.pid, _int(ev, "work"))] = ev
        out = []
        for ev in events:
            call = _call(ev)
            if ev.kind == EventKind.OTHER:
                continue
            end = ev.start_ns + ev.duration_ns
            w = waits.get((ev.pid, _int(ev, "work"))) if call in SENDS | RECVS else None
            if w is not None:
                end = max(end, w.start_ns + w.duration_ns)
            out.append(_Op(ev, end))
        out.sort(key=lambda o: (o.ev.start_ns, o.ev.event_id))
        return out

    def _cpu_waits(self, seg: EtNode, start: int) -> None:
        """The communication that had completed before this CPU interval began: it may have waited for it."""
        keep = []
        for end, nid in self.done_comm:
            if end <= start:
                seg.data_deps.append(nid)
            else:
                keep.append((end, nid))
        self.done_comm = keep

    def _finished(self, n: EtNode, end: int) -> None:
        self.done_comm.append((end, n.id))

    def _op_nodes(self, op: _Op) -> list[EtNode]:
        ev, call = op.ev, _call(op.ev)
        start, dur = ev.start_ns, op.end_ns - ev.start_ns
        common = {"tid": ("int64_val", ev.tid), "runtime": ("string_val", str(ev.args.get("runtime", "")))}
        if ev.kind == EventKind.COLLECTIVE:
            if call in COLLECTIVES:
                size = _int(ev, "total_bytes" if call in USES_TOTAL and "total_bytes" in ev.args else "bytes")
                if "bytes" not in ev.args:
                    self.warnings.append(f"rank {self.rank}: {call} at {ev.start_ns} ns without a size")
                if _int(ev, "group_size") and _int(ev, "group_size") != self.world:
                    self.warnings.append(f"rank {self.rank}: {call} in a subgroup of {_int(ev, 'group_size')} "
                                         "ranks written to the default group")
                n = self.node(call, COMM_COLL, start, dur, is_cpu_op=("bool_val", False),
                              comm_type=("int64_val", COLLECTIVES[call]), comm_size=("int64_val", size),
                              comm_priority=("int32_val", 0), pg_name=("string_val", ""), **common)
                self._collective(n, ev)
                self.coll_seq += 1
                return [n]
            if call in DECOMPOSED:
                made = self._decomposed(ev, call, start, dur, common)
                self.coll_seq += 1
                return made
            if call in SENDS or call in RECVS:
                return [self._p2p(ev, call, start, dur, common)]
            self.warnings.append(f"rank {self.rank}: collective {call} is not representable; left out")
            return []
        if ev.kind == EventKind.COMPUTE:
            stream = _int(ev, "stream")
            n = self.node(ev.name, COMP, start, _int(ev, "gpu_ns"), is_cpu_op=("bool_val", False),
                          stream=("int64_val", stream), **common)
            self.chain(n, ("stream", stream))
            return [n]
        if ev.kind == EventKind.COPY:
            direction = str(ev.args.get("direction", ""))
            stream = _int(ev, "stream")
            tsize = ("uint64_val", max(_int(ev, "bytes"), 0))
            if direction in TO_DEVICE or direction in TO_HOST:
                n = self.node(f"{call} {direction}", MEM_LOAD if direction in TO_DEVICE else MEM_STORE, start, dur,
                              tensor_size=tsize, is_cpu_op=("bool_val", False), stream=("int64_val", stream), **common)
            else:  # on the device (DtoD, memset) or host-only: compute of its stream
                n = self.node(f"{call} {direction}".strip(), COMP, start, dur, tensor_size=tsize,
                              is_cpu_op=("bool_val", False), stream=("int64_val", stream), **common)
            self.chain(n, ("stream", stream))
            if call in SYNC_COPIES:
                self._finished(n, op.end_ns)
            return [n]
        if ev.kind == EventKind.SYNC:
            n = self.node(call, COMP, start, 0, is_cpu_op=("bool_val", True), **common)
            self.chain(n, ("cpu", 0))
            if call in P2P_WAITS:  # gloo: the wait of a posted send/recv
                posted = self.posted.get((ev.pid, _int(ev, "work")))
                targets = [posted] if posted is not None else []
            elif "stream" in ev.args:
                prev = self.last_on_lane.get(("stream", _int(ev, "stream")))
                targets = [prev] if prev is not None else []
            else:  # a device or event sync: every stream
                targets = [nid for (kind, _), nid in self.last_on_lane.items() if kind == "stream"]
            n.data_deps.extend(t for t in targets if t not in n.data_deps)
            self._finished(n, op.end_ns)
            return [n]
        return []

    def _collective(self, n: EtNode, ev: TraceEvent) -> None:
        self.chain(n, ("thread", ev.tid))
        if self.last_coll is not None and self.last_coll not in n.ctrl_deps:
            n.ctrl_deps.append(self.last_coll)
        self.last_coll = n.id
        self._finished(n, ev.start_ns + ev.duration_ns)

    def _p2p(self, ev: TraceEvent, call: str, start: int, dur: int, common: dict[str, tuple[str, Any]]) -> EtNode:
        peer = _int(ev, "peer", -1)
        send = call in SENDS
        if not 0 <= peer < self.world:
            self.warnings.append(f"rank {self.rank}: {call} with peer {peer} outside the job")
        src, dst = (self.rank, peer) if send else (peer, self.rank)
        if "tag" in ev.args:
            tag = _int(ev, "tag")
        else:
            tag = P2P_TAG + self.p2p_seq[(src, dst)]
            self.p2p_seq[(src, dst)] += 1
        n = self.node(call, COMM_SEND if send else COMM_RECV, start, dur, is_cpu_op=("bool_val", False),
                      comm_src=("int32_val", src), comm_dst=("int32_val", dst), comm_tag=("int32_val", tag),
                      comm_size=("int64_val", _int(ev, "bytes")), **common)
        self.chain(n, ("thread", ev.tid))
        self._finished(n, start + dur)
        if "work" in ev.args:
            self.posted[(ev.pid, _int(ev, "work"))] = n.id
        return n

    def _decomposed(self, ev: TraceEvent, call: str, start: int, dur: int,
                    common: dict[str, tuple[str, Any]]) -> list[EtNode]:
        shape = DECOMPOSED[call]
        root = _int(ev, "root", 0)
        size = _int(ev, "bytes")
        tag = DECOMPOSED_TAG + self.coll_seq
        others = [r for r in range(self.world) if r != root]
        steps: list[tuple[bool, int]] = []  # (send?, peer)
        if shape == "to_root":
            steps = [(False, r) for r in others] if self.rank == root else [(True, root)]
        elif shape == "from_root":
            steps = [(True, r) for r in others] if self.rank == root else [(False, root)]
        else:  # barrier: everyone reports to rank 0, which then releases them
            root, size = 0, 0
            others = [r for r in range(self.world) if r != 0]
            steps = ([(False, r) for r in others] + [(True, r) for r in others] if self.rank == 0
                     else [(True, 0), (False, 0)])
        made: list[EtNode] = []
        for send, peer in steps:
            src, dst = (self.rank, peer) if send else (peer, self.rank)
            n = self.node(f"{call}:{'send' if send else 'recv'}", COMM_SEND if send else COMM_RECV, start, dur,
                          is_cpu_op=("bool_val", False), comm_src=("int32_val", src), comm_dst=("int32_val", dst),
                          comm_tag=("int32_val", tag), comm_size=("int64_val", size),
                          root=("int32_val", root), **common)
            if made:
                n.ctrl_deps.append(made[-1].id)
            else:
                self._collective(n, ev)
            made.append(n)
        if made:
            self.last_coll = made[-1].id
            self.last_on_lane[("thread", ev.tid)] = made[-1].id
            self._finished(made[-1], start + dur)
        return made


def _compute_threads(prof: Profile) -> set[tuple[int, int]]:
    """The (pid, tid) whose samples name CPU compute: threads that ran Python, else every thread but those that
    only ran collectives (a communication library's workers and transport threads)."""
    threads = {(s.pid, s.tid) for s in prof.samples}
    python = {(s.pid, s.tid) for s in prof.samples if any(f.kind == FrameKind.PYTHON for f in s.stack)}
    python_pids = {pid for pid, _ in python}
    comm = {(e.pid, e.tid) for e in prof.events if e.kind == EventKind.COLLECTIVE and e.tid != e.pid}
    return {t for t in threads if (t in python if t[0] in python_pids else t not in comm)}


def build_traces(prof: Profile) -> ChakraTraces:
    """Per-rank Chakra nodes for a symbolized capture; raises ChakraError when it has no communication."""
    warnings: list[str] = []
    comm = [e for e in prof.events if e.kind in (EventKind.COLLECTIVE, EventKind.COMPUTE, EventKind.COPY)]
    if not comm:
        raise NoCommunication("no collectives, kernel launches or copies in this capture: nothing for a Chakra trace "
                          "(was it taken with --no-runtimes, or does the job use no probed runtime?)")
    pid_rank, world = assign_ranks(prof, warnings)
    events: dict[int, list[TraceEvent]] = defaultdict(list)
    for ev in prof.events:
        events[pid_rank[ev.pid]].append(ev)
    samples: dict[int, list[tuple[int, tuple[Frame, ...]]]] = defaultdict(list)
    naming = _compute_threads(prof)
    for s in prof.samples:
        r = pid_rank.get(s.pid)
        if r is not None and s.time_ns and (s.pid, s.tid) in naming:
            samples[r].append((s.time_ns, s.stack))
    out: dict[int, RankTrace] = {}
    for r in sorted(set(pid_rank.values())):
        pids = sorted(p for p, rr in pid_rank.items() if rr == r)
        nodes = _RankBuilder(r, world, pids, warnings).build(events[r], samples[r])
        if not nodes:
            warnings.append(f"rank {r}: no nodes")
        out[r] = RankTrace(r, world, pids, nodes)
    missing = sorted(set(range(world)) - out.keys())
    if missing:
        warnings.append(f"ranks {', '.join(map(str, missing))} of {world} were not captured: no file for them")
    return ChakraTraces(out, warnings)


def node_types(nodes: Sequence[EtNode]) -> Counter[str]:
    """How many nodes of each type (for summaries)."""
    return Counter(NODE_TYPE_NAMES.get(n.type, str(n.type)) for n in nodes)

"""The nodes of Chakra execution traces, per rank, that ASTRA-sim's analytical backend replays unedited (its input
rules: docs/chakra.md), built from the intervals of exporters/rank_timeline.py; exporters/chakra.py encodes and
writes them. docs/chakra.md explains every mapping decision; in short:

- a collective: COMM_COLL with the `comm_type` and `comm_size` the simulator's model of it expects, identical on
  every rank and in the same order (the job's collective order, `rank_timeline.match_collectives`). The size is
  the one the simulator's ring model moves as the real call did (COLLECTIVE_MAP); collectives it cannot run are
  written as the nearest one it can (a barrier is a 1-byte ALL_REDUCE, never a 0-byte message), with
  `aiflame_mapped` saying so. The rank's real size stays in `aiflame_bytes`;
- a send or recv: COMM_SEND/COMM_RECV with `comm_src`, `comm_dst`, `comm_tag` and a `comm_size` > 0 that the
  two sides agree on, paired across ranks in order;
- compute: one COMP node per piece of the rank's window between communication boundaries that held compute,
  lasting only the compute (rank_timeline says how it is measured). These nodes are the work of the simulated
  NPU: not `is_cpu_op`. On a host-only (CPU) job the NPU is the rank's compute threads; on a rank that launched
  kernels it is the device: its COMP nodes are the kernels (their device time when the capture has it) and the
  copies (with `tensor_size`), and host time is not simulated.

Dependencies all point back in time (ids grow along every edge, so the trace is a DAG): the compute nodes form a
chain in program order; a communication call depends on the compute piece before it (which made its buffer) and
on the communication that had ended before it started; collectives are chained in the job's order; a compute
piece depends on the communication that had ended before it began, so in the simulator compute waits for the
communication it waited for in the capture, and no longer. Nothing else is emitted: no METADATA, MEM or INVALID
node and no `is_cpu_op` true (the simulator aborts on them or refuses its overlap statistics).

Over 400 lines on purpose: the decisions above (COLLECTIVE_MAP, the plan every rank writes, message pairing, each
rank's nodes and dependencies) are one mapping, kept with this explanation of it.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiflame.core.errors import NothingToShow
from aiflame.core.model import EventKind, Profile, TraceEvent

from .chakra_network import P2P, steps_and_bytes
from .rank_timeline import CommOp, JobTimeline, RankTimeline, build_timeline, call_name

HostCosts = Callable[[str, float], int | None]  # (call, simulated bytes) -> host ns beyond the network

MIN_COMPUTE_NS = 1000  # compute pieces shorter than a microsecond are not worth a node
P2P_TAG = 1 << 29  # send/recv tags start here, clear of the simulator's collective stream tags (0, 1, 2, ...)
UNTAGGED = 1 << 30  # sends/recvs without a runtime tag (NCCL): UNTAGGED + n for the n-th between two ranks
MIN_ALL_GATHER = 64  # an ALL_GATHER below preferred-dataset-splits bytes never finishes in the simulator

# Chakra's NodeType and CollectiveCommType values (et_def.proto), so building needs no protobuf import.
METADATA, MEM_LOAD, MEM_STORE, COMP, COMM_SEND, COMM_RECV, COMM_COLL = 1, 2, 3, 4, 5, 6, 7
ALL_REDUCE, REDUCE, ALL_GATHER, GATHER, SCATTER, BROADCAST, ALL_TO_ALL, REDUCE_SCATTER = 0, 1, 2, 3, 4, 5, 6, 7
NODE_TYPE_NAMES = {MEM_LOAD: "MEM_LOAD", MEM_STORE: "MEM_STORE", COMP: "COMP", COMM_SEND: "COMM_SEND",
                   COMM_RECV: "COMM_RECV", COMM_COLL: "COMM_COLL"}
COMM_TYPE_NAMES = {ALL_REDUCE: "ALL_REDUCE", ALL_GATHER: "ALL_GATHER", ALL_TO_ALL: "ALL_TO_ALL",
                   REDUCE_SCATTER: "REDUCE_SCATTER", BROADCAST: "BROADCAST"}


@dataclass(frozen=True, slots=True)
class Mapping:
    """How one runtime call becomes a simulated collective: its type, the size rule (below), and what the
    mapping means when the call is not simulated as itself."""

    comm_type: int
    size: str  # "buffer" | "shard" | "per_peer_share" | "alltoall" | "total" | "barrier"
    note: str = ""


# Sizes in the simulator's ring model (docs/chakra.md): ALL_REDUCE moves its buffer S, ALL_GATHER (N-1) x its
# shard, REDUCE_SCATTER (N-1)/N x its input, ALL_TO_ALL (N-1)/N x its send buffer (direct) per rank.
COLLECTIVE_MAP: dict[str, Mapping] = {
    "allreduce": Mapping(ALL_REDUCE, "buffer"),
    "ncclAllReduce": Mapping(ALL_REDUCE, "buffer"),
    "allgather": Mapping(ALL_GATHER, "shard"),
    "allgatherv": Mapping(ALL_GATHER, "shard"),
    "ncclAllGather": Mapping(ALL_GATHER, "shard"),
    "alltoall": Mapping(ALL_TO_ALL, "alltoall"),
    "alltoallv": Mapping(ALL_TO_ALL, "alltoall"),
    "ncclAlltoAll": Mapping(ALL_TO_ALL, "total"),
    "ncclReduceScatter": Mapping(REDUCE_SCATTER, "total"),
    "reduce": Mapping(ALL_REDUCE, "buffer", "reduce as an ALL_REDUCE of its buffer (a ring reduce moves as much)"),
    "ncclReduce": Mapping(ALL_REDUCE, "buffer", "reduce as an ALL_REDUCE of its buffer (a ring reduce moves as much)"),
    "broadcast": Mapping(ALL_GATHER, "per_peer_share",
                         "broadcast as an ALL_GATHER of buffer/(N-1) bytes: each rank moves the buffer once, as a "
                         "pipelined broadcast does (BROADCAST is replayed, not simulated: no rank would wait)"),
    "ncclBroadcast": Mapping(ALL_GATHER, "per_peer_share", "broadcast as an ALL_GATHER of buffer/(N-1) bytes"),
    "ncclBcast": Mapping(ALL_GATHER, "per_peer_share", "broadcast as an ALL_GATHER of buffer/(N-1) bytes"),
    "gather": Mapping(ALL_GATHER, "shard", "gather as an ALL_GATHER of each rank's input (the root receives as much)"),
    "ncclGather": Mapping(ALL_GATHER, "shard", "gather as an ALL_GATHER of each rank's input"),
    "scatter": Mapping(ALL_GATHER, "shard", "scatter as an ALL_GATHER of each rank's output (the root sends as much)"),
    "ncclScatter": Mapping(ALL_GATHER, "shard", "scatter as an ALL_GATHER of each rank's output"),
    "barrier": Mapping(ALL_REDUCE, "barrier", "barrier as a 1-byte ALL_REDUCE"),
}


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


@dataclass(frozen=True, slots=True)
class Planned:
    """A collective as every rank writes it."""

    comm_type: int
    comm_size: int
    call: str
    note: str  # how it was mapped, "" when simulated as itself


@dataclass(slots=True)
class ChakraTraces:
    """The traces of every rank in a capture, what they were made from, and what could not be represented
    exactly."""

    ranks: dict[int, RankTrace]
    timeline: JobTimeline
    collectives: dict[int, Planned] = field(default_factory=dict)  # seq -> how it is written
    warnings: list[str] = field(default_factory=list)
    network: Any = None  # chakra_network.NetworkFit, once written
    extra_files: list[Path] = field(default_factory=list)  # written besides the .et files
    problems: list[Any] = field(default_factory=list)  # chakra_check.Problem of the written files


# --- building -------------------------------------------------------------------------------------------------


def plan_collective(parts: dict[int, CommOp], world: int) -> Planned | None:
    """The type and size one collective gets on every rank, from all ranks' parts of it; None when the call is
    not one the simulator can stand in for."""
    call = next(iter(parts.values())).call
    m = COLLECTIVE_MAP.get(call)
    if m is None:
        return None
    sizes = [op.bytes for op in parts.values() if op.bytes >= 0]
    biggest = max(sizes, default=0)
    peers = max(world - 1, 1)
    if m.size == "barrier":
        size = 1
    elif m.size == "per_peer_share":
        size = math.ceil(biggest / peers)
    elif m.size == "total":
        totals = [int(op.event.args.get("total_bytes", 0) or 0) for op in parts.values()]
        size = max(totals) if all(totals) else biggest * world
    elif m.size == "alltoall":
        # what the busiest rank sends to the others, as the send buffer of an even all-to-all that sends as much
        sent = [op.event.args.get("wire_sent") for op in parts.values()]
        if all(isinstance(s, int) for s in sent) and world > 1:
            size = math.ceil(max(int(s or 0) for s in sent) * world / peers)
        else:
            size = biggest
    else:
        size = biggest
    note = m.note
    if m.size == "alltoall" and len(set(sizes)) > 1:
        note = ("uneven all-to-all as an even one of N/(N-1) x the most any rank sent to the others "
                "(its real send buffer: aiflame_bytes)")
    elif m.size in ("buffer", "shard") and len(set(sizes)) > 1 and not note:
        note = f"ranks' sizes differ ({min(sizes)}..{biggest} B): written at the largest"
    if m.comm_type == ALL_GATHER and size < MIN_ALL_GATHER:
        size = MIN_ALL_GATHER
        note = (note + "; " if note else "") + f"raised to {MIN_ALL_GATHER} B (a smaller ALL_GATHER never finishes)"
    return Planned(m.comm_type, max(size, 1), call, note)


def pair_messages(timeline: JobTimeline, warnings: list[str]) -> dict[int, tuple[int, int, int]]:
    """id(op) -> (tag, size, message number) for every send and recv: the k-th send from a to b with a tag meets
    the k-th receive at b from a with that tag; both get the same tag (clear of the simulator's collective tags),
    size (> 0) and number."""
    sends: dict[tuple[int, int, int], list[CommOp]] = defaultdict(list)
    recvs: dict[tuple[int, int, int], list[CommOp]] = defaultdict(list)
    for r, t in sorted(timeline.ranks.items()):
        for op in t.ops:
            if op.kind == "send":
                sends[(r, op.peer, op.tag)].append(op)
            elif op.kind == "recv":
                recvs[(op.peer, r, op.tag)].append(op)
    out: dict[int, tuple[int, int, int]] = {}
    unpaired = pairs = 0
    for key in sorted(sends.keys() | recvs.keys()):
        ss, rr = sends.get(key, []), recvs.get(key, [])
        unpaired += abs(len(ss) - len(rr))
        for i in range(max(len(ss), len(rr))):
            pair = [*ss[i:i + 1], *rr[i:i + 1]]
            user_tag = key[2]
            tag = P2P_TAG + user_tag if 0 <= user_tag < P2P_TAG else UNTAGGED + i
            sizes = [op.bytes for op in pair if op.bytes >= 0]
            if len(set(sizes)) > 1:
                warnings.append(f"message {key[0]}->{key[1]} tag {user_tag}: {sizes[0]} B sent, {sizes[1]} B "
                                "received: written as sent")
            size = max(sizes[0] if sizes else 1, 1)
            for op in pair:
                out[id(op)] = (tag, size, pairs)
            pairs += 1
    if unpaired:
        warnings.append(f"{unpaired} sends/receives have no counterpart in the capture (a rank not captured?)")
    return out


class _RankBuilder:
    def __init__(self, t: RankTimeline, world: int, plan: dict[int, Planned],
                 messages: dict[int, tuple[int, int, int]], host: HostCosts | None = None) -> None:
        self.t, self.world, self.plan, self.messages, self.host = t, world, plan, messages, host
        self.nodes: list[EtNode] = []
        self.pending: list[tuple[int, int]] = []  # (end ns, node id) of finished calls no compute depends on yet
        self.last_comp: int | None = None
        self.last_coll: int | None = None
        self.last_on_stream: dict[int, int] = {}

    def node(self, name: str, type_: int, start: int, dur: int, **attrs: tuple[str, Any]) -> EtNode:
        n = EtNode(len(self.nodes) + 1, name, type_, start, max(dur, 0), dict(attrs))
        self.nodes.append(n)
        return n

    @staticmethod
    def dep(deps: list[int], nid: int | None) -> None:
        if nid is not None and nid not in deps:
            deps.append(nid)

    def finished_before(self, start: int) -> list[int]:
        return [nid for end, nid in self.pending if end <= start]

    def build(self) -> list[EtNode]:
        t = self.t
        device_rank = any(e.kind in (EventKind.COMPUTE, EventKind.COPY) for e in t.device)
        # (start, order, end, item): a compute piece starting where a call starts is cut there, after the call
        # was made, so it comes after the call (and the call does not wait for it)
        items: list[tuple[int, int, int, object]] = []
        if not device_rank:  # the host's compute threads are the NPU
            items += [(c.start_ns, 1, c.end_ns, c) for c in t.compute if c.compute_ns >= MIN_COMPUTE_NS]
        items += [(op.start_ns, 0, op.end_ns, op) for op in t.ops]
        items += [(e.start_ns, 0, e.start_ns + e.duration_ns, e) for e in t.device]
        items.sort(key=lambda x: (x[0], x[1], x[2]))
        for _, _, _, item in items:
            if isinstance(item, CommOp):
                self.comm(item)
            elif isinstance(item, TraceEvent):
                self.device(item)
            else:
                self.compute(item)
        return self.nodes

    def compute(self, c: Any) -> None:
        n = self.node(c.name, COMP, c.start_ns, c.compute_ns, is_cpu_op=("bool_val", False),
                      num_samples=("int64_val", c.samples), aiflame_wall_ns=("int64_val", c.wall_ns),
                      aiflame_in_comm=("bool_val", c.in_comm))
        self.dep(n.ctrl_deps, self.last_comp)
        for nid in self.finished_before(c.start_ns):
            self.dep(n.data_deps, nid)
        self.pending = [(e, nid) for e, nid in self.pending if e > c.start_ns]
        self.last_comp = n.id

    def _issued(self, n: EtNode, start: int) -> None:
        """A call depends on the compute before it and on the calls that had ended before it started."""
        self.dep(n.data_deps, self.last_comp)
        for nid in self.finished_before(start):
            self.dep(n.data_deps, nid)

    def _call(self, n: EtNode, op: CommOp, kind: str, nbytes: float) -> None:
        """A call issued; with a calibration, after its host cost (a compute node the call depends on)."""
        cost = self.host(kind, nbytes) if self.host is not None else None
        if not cost:
            self._issued(n, op.start_ns)
            return
        h = EtNode(n.id, f"host: {op.call}", COMP, op.start_ns, cost,
                   {"is_cpu_op": ("bool_val", False), "aiflame_host_cost": ("bool_val", True)})
        self._issued(h, op.start_ns)
        n.id = h.id + 1
        self.nodes.insert(len(self.nodes) - 1, h)
        n.data_deps.append(h.id)

    def comm(self, op: CommOp) -> None:
        common = {"tid": ("int64_val", op.tid), "runtime": ("string_val", str(op.event.args.get("runtime", ""))),
                  "aiflame_bytes": ("int64_val", op.bytes)}
        if op.kind == "collective":
            planned = self.plan.get(op.seq) if op.seq >= 0 else None
            if planned is None:
                return  # unmatched or not representable: warned about when planned
            extra: dict[str, tuple[str, Any]] = {"aiflame_seq": ("int64_val", op.seq)}
            if planned.note:
                extra["aiflame_mapped"] = ("string_val", planned.note)
            if op.root >= 0:
                extra["root"] = ("int32_val", op.root)
            for key in ("wire_sent", "wire_recv"):
                v = op.event.args.get(key)
                if isinstance(v, int):
                    extra[f"aiflame_{key}"] = ("int64_val", v)
            n = self.node(op.call, COMM_COLL, op.start_ns, op.duration_ns, is_cpu_op=("bool_val", False),
                          comm_type=("int64_val", planned.comm_type), comm_size=("int64_val", planned.comm_size),
                          comm_priority=("int32_val", 0), pg_name=("string_val", ""), **common, **extra)
            self._call(n, op, op.call, steps_and_bytes(planned.comm_type, planned.comm_size, self.world)[1])
            self.dep(n.ctrl_deps, self.last_coll)
            self.last_coll = n.id
            stream = op.event.args.get("stream")
            if isinstance(stream, int):
                self.dep(n.ctrl_deps, self.last_on_stream.get(stream))
                self.last_on_stream[stream] = n.id
        else:
            tag, size, _ = self.messages.get(id(op), (P2P_TAG, max(op.bytes, 1), 0))
            send = op.kind == "send"
            src, dst = (self.t.rank, op.peer) if send else (op.peer, self.t.rank)
            n = self.node(op.call, COMM_SEND if send else COMM_RECV, op.start_ns, op.duration_ns,
                          is_cpu_op=("bool_val", False), comm_src=("int32_val", src), comm_dst=("int32_val", dst),
                          comm_tag=("int32_val", tag), comm_size=("int64_val", size),
                          aiflame_tag=("int64_val", op.tag), **common)
            self._call(n, op, P2P, size)
        self.pending.append((op.end_ns, n.id))

    def device(self, ev: TraceEvent) -> None:
        """A kernel launch or copy: the device's compute, chained on its stream; a sync: the calls after it wait
        for the stream (or every stream) it waited for."""
        call = call_name(ev)
        stream = int(ev.args.get("stream", 0) or 0)
        end = ev.start_ns + ev.duration_ns
        common = {"tid": ("int64_val", ev.tid), "runtime": ("string_val", str(ev.args.get("runtime", ""))),
                  "stream": ("int64_val", stream)}
        if ev.kind == EventKind.SYNC:
            if "stream" in ev.args:
                targets = [self.last_on_stream.get(stream)]
            else:
                targets = list(self.last_on_stream.values())
            self.pending += [(end, nid) for nid in targets if nid is not None]
            return
        if ev.kind == EventKind.COMPUTE:
            gpu_ns = ev.args.get("gpu_ns")
            n = self.node(ev.name, COMP, ev.start_ns, int(gpu_ns) if isinstance(gpu_ns, int | float) else 0,
                          is_cpu_op=("bool_val", False), **common)
        else:  # a copy: the device's (or copy engine's) work, with its size
            direction = str(ev.args.get("direction", ""))
            size = ev.args.get("bytes")
            gpu_ns = ev.args.get("gpu_ns")
            dur = int(gpu_ns) if isinstance(gpu_ns, int | float) else ev.duration_ns
            n = self.node(f"{call} {direction}".strip(), COMP, ev.start_ns, dur, is_cpu_op=("bool_val", False),
                          **common)
            if isinstance(size, int) and size > 0:
                n.attrs["tensor_size"] = ("uint64_val", size)
        self._issued(n, ev.start_ns)
        self.dep(n.ctrl_deps, self.last_on_stream.get(stream))
        self.last_on_stream[stream] = n.id
        if call in ("cudaMemcpy", "cudaMemset"):  # the host waited for it
            self.pending.append((end, n.id))


def build_traces(prof: Profile, timeline: JobTimeline | None = None, host: HostCosts | None = None) -> ChakraTraces:
    """Per-rank Chakra nodes for a symbolized capture; raises NothingToShow when it has no communication. With
    `host` (a calibration's costs, exporters/chakra_calibration.py), each call is preceded by a compute node of
    what it costs the host beyond the network."""
    comm = [e for e in prof.events if e.kind in (EventKind.COLLECTIVE, EventKind.COMPUTE, EventKind.COPY)]
    if not comm:
        raise NothingToShow("no collectives, kernel launches or copies in this capture: nothing for a Chakra trace "
                            "(was it taken with --no-runtimes, or does the job use no probed runtime?)")
    tl = timeline or build_timeline(prof)
    warnings = list(tl.warnings)
    plan: dict[int, Planned] = {}
    skipped: Counter[str] = Counter()
    for seq, parts in sorted(tl.collectives().items()):
        p = plan_collective(parts, tl.world)
        if p is None:
            skipped[next(iter(parts.values())).call] += 1
        else:
            plan[seq] = p
    for call, n in sorted(skipped.items()):
        warnings.append(f"collective {call} ({n}x) has no counterpart in the simulator: left out")
    for r, t in tl.ranks.items():
        for op in t.ops:
            if op.kind == "collective" and op.bytes < 0 and op.call != "barrier":
                warnings.append(f"rank {r}: {op.call} at {op.event.start_ns} ns without a size")
            gs = op.event.args.get("group_size")
            if op.kind == "collective" and isinstance(gs, int) and gs and gs != tl.world:
                warnings.append(f"rank {r}: {op.call} in a subgroup of {gs} ranks written to the default group")
    messages = pair_messages(tl, warnings)
    out: dict[int, RankTrace] = {}
    for r, t in sorted(tl.ranks.items()):
        nodes = _RankBuilder(t, tl.world, plan, messages, host).build()
        if not nodes:
            warnings.append(f"rank {r}: no nodes")
        out[r] = RankTrace(r, tl.world, t.pids, nodes)
    missing = sorted(set(range(tl.world)) - out.keys())
    if missing:
        warnings.append(f"ranks {', '.join(map(str, missing))} of {tl.world} were not captured: no file for them")
    return ChakraTraces(out, tl, plan, warnings)


def node_types(nodes: Sequence[EtNode]) -> Counter[str]:
    """How many nodes of each type (for summaries)."""
    return Counter(NODE_TYPE_NAMES.get(n.type, str(n.type)) for n in nodes)

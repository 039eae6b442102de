"""An ASTRA-sim analytical network fitted to a capture: the link bandwidth and latency with which the simulator's
collectives and messages take as long as the captured ones did, so a replay starts from the network the job
really had (a user then changes the bandwidth to ask what a faster one would do).

The simulator's time for one collective of `comm_size` S on a Switch of N NPUs, ring algorithms and P
`preferred-dataset-splits` (1 cycle = 1 ns, bandwidth in GiB/s, measured on the analytical backend for N = 2):

    time = L × latency + B / bandwidth
    ALL_REDUCE      L = 4P(N-1)      B = 2(N-1)/N × S
    ALL_GATHER      L = 2P(N-1)      B = (N-1) × S
    REDUCE_SCATTER  L = 2P(N-1)      B = (N-1)/N × S
    ALL_TO_ALL      L = P × N(N-1)   B = (N-1)/2 × S
    SEND/RECV       L = 2            B = S

The captured time of a collective is that of the rank that arrived last (the others' include waiting for it);
of a message, from when both sides had posted it to the receive's end. The latency is the median per-step time
of the small ones (up to SMALL bytes, where latency dominates); the bandwidth then makes the simulated total equal
the time some communication was in flight, counted once where calls overlapped (the simulator runs one at a
time per rank).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .rank_timeline import CommOp

if TYPE_CHECKING:
    from .chakra_nodes import ChakraTraces

SPLITS = 4  # preferred-dataset-splits of the system configuration the fit assumes (shared/astra-sim/system.json)
SMALL = 64 << 10
P2P = "send/recv"  # the call name of a matched message pair
GIB = 1 << 30


@dataclass(frozen=True, slots=True)
class NetworkFit:
    bandwidth_gibps: float  # GB/s as the simulator reads it (GiB/s)
    latency_ns: float
    calls: int  # collectives and messages fitted
    comm_ns: int  # the captured time they were in flight
    note: str = ""


def steps_and_bytes(comm_type: int, size: int, world: int, splits: int = SPLITS) -> tuple[float, float]:
    """(latency steps L, bytes B) of one collective in the simulator's model above."""
    from .chakra_nodes import ALL_GATHER, ALL_REDUCE, ALL_TO_ALL, REDUCE_SCATTER

    n = max(world, 2)
    if comm_type == ALL_REDUCE:
        return 4 * splits * (n - 1), 2 * (n - 1) / n * size
    if comm_type == ALL_GATHER:
        return 2 * splits * (n - 1), (n - 1) * size
    if comm_type == REDUCE_SCATTER:
        return 2 * splits * (n - 1), (n - 1) / n * size
    if comm_type == ALL_TO_ALL:
        return splits * n * (n - 1), (n - 1) / 2 * size
    return 0.0, 0.0


def _union_ns(intervals: list[tuple[int, int]]) -> int:
    total, end = 0, None
    for a, b in sorted(intervals):
        if end is None or a > end:
            total += b - a
            end = b
        elif b > end:
            total += b - end
            end = b
    return total


@dataclass(frozen=True, slots=True)
class TimedCall:
    """One call as the simulator sees it: the runtime call, its latency steps L and bytes B in the model above,
    and the captured time (the last-arriving rank's, for a collective; from both sides posted to the receive's
    end, for a message)."""

    call: str
    steps: float
    nbytes: float
    start_ns: int
    duration_ns: int


def timed_calls(traces: ChakraTraces, splits: int = SPLITS) -> list[TimedCall]:
    """Every collective all ranks made that the traces hold, and every matched send/recv pair."""
    tl = traces.timeline
    out: list[TimedCall] = []
    for seq, parts in tl.collectives().items():
        planned = traces.collectives.get(seq)
        if planned is None or len(parts) < len(tl.ranks):
            continue
        last = max(parts.values(), key=lambda op: op.start_ns)
        steps, nbytes = steps_and_bytes(planned.comm_type, planned.comm_size, tl.world, splits)
        if steps:
            out.append(TimedCall(planned.call, steps, nbytes, last.start_ns, last.duration_ns))
    recvs: dict[tuple[int, int, int], list[CommOp]] = {}
    sends: dict[tuple[int, int, int], list[CommOp]] = {}
    for r, t in tl.ranks.items():
        for op in t.ops:
            if op.kind == "send":
                sends.setdefault((r, op.peer, op.tag), []).append(op)
            elif op.kind == "recv":
                recvs.setdefault((op.peer, r, op.tag), []).append(op)
    for key, rops in recvs.items():
        for sop, rop in zip(sends.get(key, []), rops, strict=False):
            start = max(sop.start_ns, rop.start_ns)
            out.append(TimedCall(P2P, 2.0, float(max(rop.bytes, sop.bytes, 1)), start, max(rop.end_ns - start, 0)))
    return out


def fit_network(traces: ChakraTraces, splits: int = SPLITS) -> NetworkFit | None:
    """The fitted network of a job of two or more ranks with communication; None otherwise."""
    tl = traces.timeline
    if tl.world < 2 or len(tl.ranks) < 2:
        return None
    items = timed_calls(traces, splits)
    if not items:
        return None
    comm_ns = _union_ns([(c.start_ns, c.start_ns + c.duration_ns) for c in items])
    small = [c.duration_ns / c.steps for c in items if c.nbytes <= SMALL and c.steps]
    latency = statistics.median(small) if small else 0.0
    steps_total = sum(c.steps for c in items)
    bytes_total = sum(c.nbytes for c in items)
    note = ""
    left = comm_ns - latency * steps_total
    if left <= 0 or bytes_total <= 0:  # the small calls' latency explains it all: fit the bandwidth alone
        latency, left = 0.0, float(comm_ns)
        note = "latency not separable from bandwidth in this capture: latency 0"
    ns_per_byte = left / bytes_total if bytes_total else 0.0
    bandwidth = 1e9 / (ns_per_byte * GIB) if ns_per_byte > 0 else 1e6
    return NetworkFit(bandwidth, latency, len(items), comm_ns, note)


FITTED_MARK = "# aiflame-fitted-on: "


def network_yaml(fit: NetworkFit, world: int, source: str = "") -> str:
    """The network configuration file (astra-network-analytical's YAML) of a network fitted to the capture
    `source` names (chakra_calibration.capture_id)."""
    lines = [
        "# ASTRA-sim analytical network fitted by aiflame to the captured communication: with ring collectives",
        f"# and preferred-dataset-splits {SPLITS} (as in shared/astra-sim/system.json), the simulator's collectives",
        f"# and messages take as long as the {fit.calls} captured ones did ({fit.comm_ns / 1e6:.3f} ms in flight).",
        "# It describes this job, gloo's or NCCL's per-call cost included: a replay with it reproduces the job, it",
        "# does not predict another, nor this one on a faster network. For that, calibrate once on a size sweep",
        "# (aiflame chakra calibrate) and export with --opt network=FILE (docs/chakra.md).",
        FITTED_MARK + source,
    ]
    if fit.note:
        lines.append(f"# {fit.note}")
    lines += [
        "topology: [ Switch ]",
        f"npus_count: [ {world} ]",
        f"bandwidth: [ {fit.bandwidth_gibps:.6g} ]   # GB/s per link (the simulator counts 2^30 bytes)",
        f"latency: [ {fit.latency_ns:.6g} ]   # ns per link",
    ]
    return "\n".join(lines) + "\n"


def fitted_source(text: str) -> str | None:
    """The capture a network file was fitted to (network_yaml's mark), or None."""
    for line in text.splitlines():
        if line.startswith(FITTED_MARK):
            return line[len(FITTED_MARK):].strip()
    return None

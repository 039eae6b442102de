"""A network calibrated once for a host and transport, that predicts jobs it was not fitted on (docs/chakra.md,
"A network that predicts other jobs").

A network fitted to one job (chakra_network.fit_network) puts everything the job's calls cost into one bandwidth
and one latency, gloo's per-call software cost included, so it describes that job. Calibrated instead on calls
of every kind across sizes (examples/comm_jobs.py sweep, or any capture whose calls span sizes), each runtime
call k gets its own line, captured time = a_k + c_k x B (B: the bytes the simulator's model moves for it,
chakra_network.steps_and_bytes), and the cost splits in two:

- the link: the fastest rate any call kind reached per byte is the bandwidth, and the latency the smallest
  per-step intercept (a_k / L_k); a faster network changes only this part;
- the host: what each kind costs beyond the link, a_k - L_k x latency per call plus (c_k - 1/bandwidth) per byte
  (the transport's copies and reductions, its call overhead). In the traces it is a compute node before the
  call ("host: allreduce"), which a faster network does not shorten.

The calibration is written into the network file as one comment line (`# aiflame-calibration: {json}`) that
ASTRA-sim ignores, with the capture it came from, so an export or `report sim` can tell a prediction from a
reproduction.
"""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from aiflame.core.errors import NothingToShow, Unreadable

from .chakra_network import GIB, SMALL, SPLITS, TimedCall, timed_calls
from .chakra_nodes import COLLECTIVE_MAP

if TYPE_CHECKING:
    from aiflame.core.model import Profile

    from .chakra_nodes import ChakraTraces

MARK = "# aiflame-calibration: "
MIN_SIZES = 3  # distinct sizes a call kind needs for its own line
ALIASES = {"alltoallv": "alltoall", "allgatherv": "allgather", "ncclBcast": "ncclBroadcast"}


@dataclass(frozen=True, slots=True)
class HostCost:
    """What one call kind costs on the host beyond the link: per call and per simulated byte."""

    per_call_ns: float
    per_byte_ns: float
    calls: int
    sizes: int  # distinct sizes it was fitted on

    def ns(self, nbytes: float) -> int:
        return round(self.per_call_ns + self.per_byte_ns * nbytes)


@dataclass(frozen=True, slots=True)
class Calibration:
    bandwidth_gibps: float
    latency_ns: float
    host: dict[str, HostCost]
    source: str  # the capture it was calibrated on (capture_id)
    transport: str  # the runtime(s) of its calls
    calls: int
    world: int
    notes: list[str] = field(default_factory=list)

    def kind_for(self, call: str) -> str | None:
        """The calibrated kind that costs `call`: its own, else one the simulator runs it as (reduce as allreduce,
        gather and scatter as allgather, ...); None when there is neither."""
        kind = ALIASES.get(call, call)
        if kind in self.host:
            return kind
        m = COLLECTIVE_MAP.get(call)
        if m is None:
            return None
        return next((k for k in self.host if k in COLLECTIVE_MAP and COLLECTIVE_MAP[k].comm_type == m.comm_type
                     and COLLECTIVE_MAP[k].note == ""), None)

    def host_ns(self, call: str, nbytes: float) -> int | None:
        """The host cost of one call; None for a call no calibrated kind stands for."""
        kind = self.kind_for(call)
        return None if kind is None else self.host[kind].ns(nbytes)

    def stand_ins(self, calls: set[str]) -> list[str]:
        """One line per call of a job that the calibration has no line of its own for."""
        out = []
        for call in sorted(calls):
            kind = self.kind_for(call)
            if kind != ALIASES.get(call, call):
                out.append(f"{call}: not in the calibration, " +
                           (f"costed as {kind}" if kind else "no host cost (the link's time only)"))
        return out

    def to_json(self) -> str:
        d = asdict(self)
        d["host"] = {k: asdict(v) for k, v in self.host.items()}
        return json.dumps(d, sort_keys=True, separators=(",", ":"))


MAX_FILE = 1 << 20  # a network file is a few lines


def read_network_file(path: Path) -> str:
    """The text of the network file at `path` (at most MAX_FILE bytes); Unreadable (one line) otherwise."""
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_FILE + 1)
    except OSError as e:
        raise Unreadable(f"{path}: {e.strerror or e}") from None
    if len(raw) > MAX_FILE:
        raise Unreadable(f"{path}: over {MAX_FILE} bytes: not a network file")
    return raw.decode("utf-8", "replace")


def load_calibration(path: Path) -> Calibration:
    """The calibration in the network file at `path`; Unreadable (one line) when there is none."""
    cal = read_calibration(read_network_file(path), str(path))
    if cal is None:
        raise Unreadable(f"{path}: no aiflame-calibration line: not a calibrated network (make one with "
                         "`aiflame chakra calibrate CAPTURE`; a network fitted to one job predicts no other)")
    return cal


def capture_id(prof: Profile) -> str:
    """Names one capture across copies and re-exports: its host, boot and start instant."""
    m = prof.meta
    return f"{m.get('host', '?')}/{m.get('boot_id', '?')[:8]}/{m.get('start_wall_ns', prof.start_ns)}"


def _line(points: list[tuple[float, float]]) -> tuple[float, float]:
    """(intercept, slope) of the line through (x, y) points with the least relative error (each point weighted
    by 1/y^2, so a 4 KiB call counts as much as a 16 MiB one), both clamped at 0."""
    w = [1.0 / (y * y) if y > 0 else 0.0 for _, y in points]
    sw = sum(w)
    if sw <= 0:
        return 0.0, 0.0
    mx = sum(wi * x for wi, (x, _) in zip(w, points, strict=True)) / sw
    my = sum(wi * y for wi, (_, y) in zip(w, points, strict=True)) / sw
    sxx = sum(wi * (x - mx) ** 2 for wi, (x, _) in zip(w, points, strict=True))
    sxy = sum(wi * (x - mx) * (y - my) for wi, (x, y) in zip(w, points, strict=True))
    slope = max(sxy / sxx if sxx > 0 else 0.0, 0.0)
    return max(my - slope * mx, 0.0), slope


def calibrate(traces: ChakraTraces, source: str, transport: str = "", splits: int = SPLITS) -> Calibration:
    """The calibration of the calls in `traces` (see the module's docstring). Each kind's line goes through the
    median time at each size, so a call that waited for a late rank or was preempted weighs as one of many."""
    calls = timed_calls(traces, splits)
    by_kind: dict[str, dict[float, list[TimedCall]]] = defaultdict(lambda: defaultdict(list))
    for call in calls:
        by_kind[ALIASES.get(call.call, call.call)][call.nbytes].append(call)
    medians = {kind: {b: statistics.median(x.duration_ns for x in cs) for b, cs in sizes.items()}
               for kind, sizes in by_kind.items()}  # the typical time of each kind at each size
    lines: dict[str, tuple[float, float, float, int, int]] = {}  # kind -> (a, c, L, calls, sizes)
    for kind, sizes in by_kind.items():
        pts = list(medians[kind].items())
        steps = next(iter(sizes.values()))[0].steps
        n = sum(len(cs) for cs in sizes.values())
        if len(pts) >= MIN_SIZES:
            a, c = _line(pts)
            lines[kind] = (a, c, steps, n, len(pts))
        else:
            lines[kind] = (-1.0, -1.0, steps, n, len(pts))  # a per-call cost only, once the link is known
    # The calls' tail (a rank or the transport's thread not scheduled at once, a preempted copy) comes at random,
    # the same for every kind: what calls took beyond the typical one of their kind and size, on average, is
    # added to every kind's per-call cost, so the calibration keeps the sweep's total time.
    excess = [max(x.duration_ns - medians[kind][b], 0)
              for kind, sizes in by_kind.items() for b, cs in sizes.items() if b <= SMALL for x in cs]
    tail = statistics.fmean(excess) if excess else 0.0
    swept = {k: v for k, v in lines.items() if v[0] >= 0 and v[1] > 0}
    if not swept:
        raise NothingToShow(f"no call kind was made at {MIN_SIZES} or more sizes: nothing separates bandwidth "
                            "from per-call cost (calibrate on a size sweep: examples/comm_jobs.py sweep)")
    per_byte = min(v[1] for v in swept.values())
    latency = min(v[0] / v[2] for v in swept.values() if v[2])
    host: dict[str, HostCost] = {}
    notes = []
    for kind, (a, c, steps, n, nsizes) in sorted(lines.items()):
        if a < 0:  # too few sizes: its own per-call cost at the link's rate
            mids = [m - b * per_byte for b, m in medians[kind].items()]
            # (the tail is added below, as to every kind)
            a, c = max(statistics.median(mids), steps * latency), per_byte
            notes.append(f"{kind}: {nsizes} size(s) only, per-call cost at the link's rate")
        host[kind] = HostCost(max(a - steps * latency, 0.0) + tail, max(c - per_byte, 0.0), n, nsizes)
    bandwidth = 1e9 / (per_byte * GIB)
    return Calibration(bandwidth, latency, host, source, transport, len(calls), traces.timeline.world, notes)


def calibration_yaml(cal: Calibration, world: int) -> str:
    """The network file of a calibration (astra-network-analytical's YAML) for a job of `world` ranks."""
    kinds = ", ".join(f"{k} {h.per_call_ns / 1e3:.0f} µs + {h.per_byte_ns:.3g} ns/B" for k, h in cal.host.items())
    lines = [
        f"# ASTRA-sim analytical network calibrated by aiflame on capture {cal.source}",
        f"# ({cal.calls} calls over {cal.transport or 'the job runtime'}, {cal.world} ranks): the link is the fastest "
        "rate any call reached per byte",
        "# and the smallest per-step latency; what each call kind costs beyond it stays on the host as compute nodes",
        f"# in the traces exported with it (aiflame export --network): {kinds}.",
        "# Change bandwidth or latency to ask what another network would do; the host part does not change.",
        *(f"# note: {n}" for n in cal.notes),
        MARK + cal.to_json(),
        "topology: [ Switch ]",
        f"npus_count: [ {world} ]",
        f"bandwidth: [ {cal.bandwidth_gibps:.6g} ]   # GB/s per link (the simulator counts 2^30 bytes)",
        f"latency: [ {cal.latency_ns:.6g} ]   # ns per link",
    ]
    return "\n".join(lines) + "\n"


def read_calibration(text: str, name: str = "network file") -> Calibration | None:
    """The calibration in a network file; None for a file without one (a network fitted to one capture, or
    written by hand). Raises Unreadable for a calibration line that cannot be read."""
    for line in text.splitlines():
        if not line.startswith(MARK):
            continue
        try:
            d = json.loads(line[len(MARK):])
            host = {str(k): HostCost(float(v["per_call_ns"]), float(v["per_byte_ns"]), int(v["calls"]),
                                     int(v["sizes"])) for k, v in dict(d["host"]).items()}
            cal = Calibration(float(d["bandwidth_gibps"]), float(d["latency_ns"]), host, str(d["source"]),
                              str(d["transport"]), int(d["calls"]), int(d["world"]), [str(n) for n in d["notes"]])
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise Unreadable(f"{name}: the aiflame-calibration line cannot be read ({type(e).__name__})") \
                from None
        if not (cal.bandwidth_gibps > 0 and cal.latency_ns >= 0) or any(
                h.per_call_ns < 0 or h.per_byte_ns < 0 for h in cal.host.values()):
            raise Unreadable(f"{name}: the aiflame-calibration line holds a negative or zero cost")
        return cal
    return None


__all__ = ["MARK", "Calibration", "HostCost", "calibrate", "calibration_yaml", "capture_id", "load_calibration",
           "read_calibration", "read_network_file"]

"""The simulator beside the capture: ASTRA-sim's per-rank time and exposed communication (its output lines
`sys[i] finished, T cycles, exposed communication E cycles.`, 1 cycle = 1 ns) set against what the capture
measured over the same window (exporters/rank_timeline.py): the rank's window, and the time communication was in
flight while the rank did not compute.

The two exposed figures are the same quantity. The simulator counts as exposed everything that is not compute
(E = T - the COMP nodes' sum), and the COMP nodes hold exactly the measured compute; the capture's window divides
into compute + exposed + idle (blocked outside communication), and idle is not in the trace, so the simulated
rank has none. Hence, per rank, simulated - measured exposed = T - (window - idle): the exposed error is the
error on the time the trace holds, in the same nanoseconds, over a smaller base."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from aiflame.core.errors import Unreadable

from .rank_timeline import JobTimeline

if TYPE_CHECKING:
    from aiflame.core.model import Profile

FINISHED = re.compile(r"sys\[(\d+)\] finished, (\d+) cycles, exposed communication (\d+) cycles")
CRITICAL = re.compile(r"\[critical\]|Assertion .* failed|terminate called")


@dataclass(frozen=True, slots=True)
class SimRank:
    rank: int
    finished_ns: int
    exposed_ns: int


@dataclass(slots=True)
class SimResult:
    ranks: dict[int, SimRank]
    critical: list[str] = field(default_factory=list)  # lines saying the run went wrong


@dataclass(frozen=True, slots=True)
class Row:
    """One rank: measured and simulated (ns)."""

    rank: int
    measured_ns: int
    simulated_ns: int | None
    measured_exposed_ns: int
    simulated_exposed_ns: int | None
    compute_ns: int
    idle_ns: int

    @staticmethod
    def _error(sim: int | None, meas: int) -> float | None:
        if sim is None or meas <= 0:
            return None
        return (sim - meas) / meas

    @property
    def step_error(self) -> float | None:
        return self._error(self.simulated_ns, self.measured_ns)

    @property
    def exposed_error(self) -> float | None:
        return self._error(self.simulated_exposed_ns, self.measured_exposed_ns)

    @property
    def traced_ns(self) -> int:
        """The part of the window the trace holds (idle is not in it): what the simulated time should be."""
        return self.measured_ns - self.idle_ns

    @property
    def traced_error(self) -> float | None:
        return self._error(self.simulated_ns, self.traced_ns)


def read_sim_log(path: Path) -> SimResult:
    """The simulator's result from its output saved to a file, or from a logging folder (its log.log)."""
    p = Path(path)
    if p.is_dir():
        p = p / "log.log"
    try:
        text = p.read_text(errors="replace")
    except OSError as e:
        raise Unreadable(f"{p}: {e.strerror or e}") from None
    return parse_sim_log(text, str(p))


def parse_sim_log(text: str, name: str = "the simulator's output") -> SimResult:
    ranks: dict[int, SimRank] = {}
    critical = []
    for line in text.splitlines():
        m = FINISHED.search(line)
        if m:
            r = int(m.group(1))
            ranks[r] = SimRank(r, int(m.group(2)), int(m.group(3)))
        elif CRITICAL.search(line):
            critical.append(line.strip())
    if not ranks and not critical:
        raise Unreadable(f"{name}: no 'sys[i] finished' line: not ASTRA-sim's output, or the run did not finish")
    return SimResult(ranks, critical)


def compare(timeline: JobTimeline, sim: SimResult, host_ns: dict[int, int] | None = None) -> list[Row]:
    """One row per rank of the capture (and per rank only the simulator has). `host_ns`: per rank, the time of
    the host-cost nodes a calibrated export put before its calls: compute to the simulator, communication in the
    capture, so it goes back into the simulated exposed figure."""
    rows = []
    for r in sorted(timeline.ranks.keys() | sim.ranks.keys()):
        t = timeline.ranks.get(r)
        s = sim.ranks.get(r)
        m = t.measured if t is not None else None
        rows.append(Row(r, m.window_ns if m else 0, s.finished_ns if s else None, m.exposed_ns if m else 0,
                        s.exposed_ns + (host_ns or {}).get(r, 0) if s else None, m.compute_ns if m else 0,
                        m.idle_ns if m else 0))
    return rows


@dataclass(frozen=True, slots=True)
class Provenance:
    """Where the network the simulator was given came from, against the capture compared."""

    held_out: bool | None  # True: made from another capture (a prediction); False: from this one; None: unknown
    line: str  # what to tell the user
    host_ns: dict[int, int] = field(default_factory=dict)  # per rank: host-cost nodes' time (calibrated export)


def provenance(prof: Profile, network_text: str, name: str) -> Provenance:
    """Whether the network file `name` was fitted or calibrated on the capture `prof` (its aiflame marks)."""
    from .chakra_calibration import capture_id, read_calibration
    from .chakra_network import fitted_source
    from .chakra_nodes import COMP, build_traces

    here = capture_id(prof)
    cal = read_calibration(network_text, name)
    if cal is not None:
        traces = build_traces(prof, host=cal.host_ns)
        host = {r: sum(n.duration_ns for n in t.nodes if n.type == COMP and "aiflame_host_cost" in n.attrs)
                for r, t in traces.ranks.items()}
        if cal.source == here:
            return Provenance(False, f"{name} was calibrated on this capture: the agreement below is a fit, not a "
                              "prediction; check it on another job's capture", host)
        return Provenance(True, f"held out: {name} was calibrated on capture {cal.source}, not on this one "
                          f"({here}): the agreement below is a prediction", host)
    src = fitted_source(network_text)
    if src == here:
        return Provenance(False, f"{name} was fitted to this capture's own communication: the replay reproduces the "
                          "job by construction and says nothing of another job or network (calibrate once with "
                          "`aiflame chakra calibrate` and export with --opt network=FILE: docs/chakra.md)")
    if src:
        return Provenance(True, f"held out: {name} was fitted to capture {src}, not to this one ({here})")
    return Provenance(None, f"{name} carries no aiflame mark: whether it was fitted on this job is unknown")


def idle_notes(rows: list[Row]) -> list[str]:
    """For ranks with idle time: the simulated time against the time the trace holds (the window less idle)."""
    out = []
    for r in rows:
        if r.idle_ns > 0 and r.simulated_ns is not None and r.traced_error is not None:
            out.append(f"rank {r.rank}: {r.idle_ns / 1e6:.1f} ms idle (blocked outside communication) are not in the "
                       f"trace: against the {r.traced_ns / 1e6:.1f} ms it holds, the simulated time is "
                       f"{r.traced_error:+.1%}")
    return out


def problems(timeline: JobTimeline, sim: SimResult) -> list[str]:
    """What makes the comparison doubtful: ranks that did not finish, critical lines."""
    out = []
    unfinished = sorted(timeline.ranks.keys() - sim.ranks.keys())
    if unfinished:
        out.append(f"rank(s) {', '.join(map(str, unfinished))} did not finish in the simulation (mismatched "
                   "collectives or messages: check the traces with `aiflame chakra check`)")
    if sim.critical:
        out.append(f"the simulator reported {len(sim.critical)} critical line(s), e.g.: {sim.critical[0][:200]}")
    return out

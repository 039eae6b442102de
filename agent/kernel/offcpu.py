"""Off-CPU records paired into off-CPU samples (bpf/offcpu.bpf.c): a blocked thread's stack arrives when it blocks,
the end of its block when it is woken and runs again; the sample is the stack weighted by the ns in between.

The kernel sends a thread's stack before the end of the same block (the thread cannot run again until the switch
that recorded it is over, and the ring buffer keeps the order records were reserved in), so an end without its
stack, or a stack superseded by the thread's next one, means a record was lost: both are counted, never guessed."""

from __future__ import annotations

from aiflame.agent.kernel.decode import OffCpuEnd
from aiflame.core.raw import RawSample

MAX_OPEN = 1 << 16  # blocked threads held at once (as many as the BPF side's map holds, and then some)


class OffCpuPairs:
    """The stacks of threads blocked now, by tid, waiting for the end of their block. At most `limit`: a target
    whose threads block and die (never to end their block) cannot grow it; the oldest go first, counted."""

    def __init__(self, limit: int = MAX_OPEN) -> None:
        self._open: dict[int, RawSample] = {}
        self.limit = limit
        self.unpaired = 0  # blocks left out: their stack or their end was lost (ring buffer full), or evicted

    def stack(self, s: RawSample) -> None:
        """Thread s.tid blocked at this stack at s.time_ns."""
        if self._open.pop(s.tid, None) is not None:
            self.unpaired += 1  # the end of its previous block was lost
        elif len(self._open) >= self.limit:
            del self._open[next(iter(self._open))]  # the longest-blocked (dicts keep insertion order)
            self.unpaired += 1
        self._open[s.tid] = s

    def end(self, e: OffCpuEnd) -> RawSample | None:
        """The block that began at e.out_ns ended: its stack as an off-CPU sample, or None when its stack was lost."""
        s = self._open.get(e.tid)
        if s is None or s.time_ns != e.out_ns:
            self.unpaired += 1
            return None
        del self._open[e.tid]
        s.off_cpu_ns = max(e.end_ns - e.out_ns, 1)
        return s

    def finish(self, end_ns: int) -> list[RawSample]:
        """The threads still blocked when the capture ends: blocked until `end_ns`."""
        out = list(self._open.values())
        self._open.clear()
        for s in out:
            s.off_cpu_ns = max(end_ns - s.time_ns, 1)
        return out

    def __len__(self) -> int:
        return len(self._open)

"""Turn a raw capture into the model: map addresses to modules, name them, and build root -> leaf stacks."""

from __future__ import annotations

import bisect
import itertools
import operator
import os
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from aiflame.core.model import Frame, FrameKind, Profile, Sample, Stack
from aiflame.core.raw import Capture, Mapping, ProcessSnapshot, PyFlag, RawEvent, RawSample, ThreadStack
from aiflame.core.unwind import stop_of
from aiflame.symbolize.events import trace_events
from aiflame.symbolize.native import NativeSymbolizer, offset_name
from aiflame.symbolize.offcpu import with_marker
from aiflame.symbolize.python.names import PythonNames
from aiflame.symbolize.unwind_report import unwind_report

MISSING_USER = Frame("[missing user stack]", FrameKind.UNKNOWN)
UNKNOWN_KERNEL = Frame("[unknown]", FrameKind.KERNEL, module="[kernel]")
# The rest of a user stack whose frame chain broke (code without frame pointers): the native unwinder stopped.
BROKEN_CHAIN = Frame("[unwind stopped]", FrameKind.UNKNOWN)
ANON = "[anon]"  # an address in a mapping backed by no file (JIT code, trampolines)

_DEDUPE = True  # build each distinct raw stack once; tests turn it off to compare with building every sample
_UNSEEN = (Mapping(0, 0, 0, ""), -1)  # not located yet (None: located nowhere)
# A RawPyFrame's fields as a plain tuple: hashed and compared in C, unlike the dataclass's generated methods.
_PY_FIELDS = operator.attrgetter("code", "instr", "owner", "is_entry")


@dataclass(frozen=True)
class StackOptions:
    group: str = "process"  # root frames: none, process (comm), thread (comm; thread name)
    kernel: bool = True  # include kernel frames
    user: bool = True  # include user frames
    python: str = "merged"  # merged (Python frames replace the evaluator's), python (Python frames only), native
    native_interp: bool = False  # merged: keep the interpreter's own native frames (else they fold away)


class _ProcessIndex:
    """The mapping snapshots of one pid, to find the mapping that held an address at a given time."""

    def __init__(self, snaps: list[ProcessSnapshot]) -> None:
        self.snaps = sorted(snaps, key=lambda s: s.time_ns)
        self.times = [s.time_ns for s in self.snaps]
        self._starts = [sorted(m.start for m in s.mappings) for s in self.snaps]
        self._by_start = [{m.start: m for m in s.mappings} for s in self.snaps]

    def _in(self, i: int, addr: int) -> Mapping | None:
        starts = self._starts[i]
        j = bisect.bisect_right(starts, addr) - 1
        if j < 0:
            return None
        m = self._by_start[i][starts[j]]
        return m if addr < m.end else None

    def epoch(self, time_ns: int) -> int:
        """How many snapshots precede `time_ns` (0 with a single snapshot): `find` depends on time only by this."""
        return bisect.bisect_right(self.times, time_ns) if len(self.times) > 1 else 0

    def find(self, addr: int, time_ns: int) -> Mapping | None:
        # Prefer the latest snapshot taken before the sample, then later ones (read after the sample).
        k = bisect.bisect_right(self.times, time_ns)
        for i in itertools.chain(range(k - 1, -1, -1), range(k, len(self.snaps))):
            m = self._in(i, addr)
            if m is not None:
                return m
        return None

    @property
    def comm(self) -> str:
        for s in reversed(self.snaps):
            if s.comm:
                return s.comm
        return ""


def symbolize_capture(
    cap: Capture, native: NativeSymbolizer | None = None, options: StackOptions | None = None
) -> Profile:
    """Symbolize every sample of `cap`; nothing is dropped. A native frame no symbol names reads
    `module+0xOFFSET`, one in a mapping with no file `[anon]` (or the kernel's name for it, e.g. `[vdso]`), and
    where the frame chain broke, what lies rootward of it is one `[unwind stopped]`. Runtime events get their
    stacks the same way, and the host address naming a launched kernel (`args["func"]`) its name."""
    opts = options or StackOptions()
    native = native or NativeSymbolizer()
    by_pid: dict[int, list[ProcessSnapshot]] = defaultdict(list)
    for snap in cap.processes:
        by_pid[snap.pid].append(snap)
    index = {pid: _ProcessIndex(snaps) for pid, snaps in by_pid.items()}

    # Pass 1: samples' and events' user stacks located alike, and each kernel's host address; then the file
    # offsets they need named, module by module.
    locator = _Locator(index)
    sample_chains = locator.chains(cap.samples)
    event_chains = locator.chains(cap.events)
    kernel_hits = [locator.address(e.pid, e.args["func"], e.time_ns) if e.args.get("func") else None
                   for e in cap.events]
    names = {(path, build_id): native.symbolize(path, build_id or None, offsets)
             for (path, build_id), offsets in locator.wanted.items()}

    prof = Profile(unit="samples", meta={"host": cap.header.host, "kernel": cap.header.kernel,
                                         "target": cap.header.target,
                                         "frequency_hz": str(cap.header.frequency_hz),
                                         # the clock pair and boot, to join captures of several hosts
                                         "start_wall_ns": str(cap.header.start_wall_ns),
                                         "boot_id": cap.header.meta.get("boot_id", "")})
    # Pass 2: the stacks, root -> leaf.
    builder = _StackBuilder(opts, names, {pid: idx.comm for pid, idx in index.items()}, cap.kernel_symbols,
                            PythonNames(cap.py_codes, cap.py_runtimes), prof.counters)
    builder.add_samples(prof, cap.samples, sample_chains)
    event_stacks = [builder.event(e, chain) for e, chain in zip(cap.events, event_chains, strict=True)]
    stops, worst = unwind_report((s for s in cap.samples if not s.off_cpu_ns),
                                 lambda s: _outermost_file(index.get(s.pid), s))
    prof.counters.update(stops)
    if worst:
        prof.meta["unwind_worst"] = worst
    kernel_frames = [_frame_at(*hit, names) if hit else None for hit in kernel_hits]
    prof.events = trace_events(cap.events, event_stacks, kernel_frames)
    if cap.footer:
        for k, v in cap.footer.counters.items():
            prof.counters[k] = prof.counters.get(k, 0) + v
        prof.start_ns, prof.end_ns = cap.header.start_mono_ns, cap.footer.end_mono_ns
    return prof


class _Locator:
    """Pass 1: user stacks located (the mapping and file offset of each frame), and the file offsets each module
    (path, build id) needs named (`wanted`).

    Each distinct chain is located once per snapshot epoch (stacks between the same two snapshots locate alike).
    Return addresses (all but the leaf) point after the call; look up addr - 1 so the frame names the calling
    function and line. Chains that locate alike (the same addresses in another epoch, mapped the same) share a
    resolution id."""

    def __init__(self, index: dict[int, _ProcessIndex]) -> None:
        self.index = index
        self.wanted: dict[tuple[str, str], set[int]] = defaultdict(set)
        self._located: dict[tuple[int, int, int, bool], tuple[Mapping, int] | None] = {}
        self._chains: dict[tuple[int, tuple[int, ...], int], _Chain] = {}
        self._resolutions: dict[tuple[bool, tuple[tuple[str, str, int], ...]], int] = {}

    def chains(self, stacks: Sequence[ThreadStack]) -> list[_Chain]:
        """The user chain of each of `stacks`, located, in order."""
        index, located, chains = self.index, self._located, self._chains
        out: list[_Chain] = []
        for s in stacks:
            idx = index.get(s.pid)
            when = idx.epoch(s.time_ns) if idx else 0
            chain = chains.get((s.pid, s.user, when))
            if chain is None:
                hits: list[tuple[Mapping, int]] = []
                for depth, addr in enumerate(s.user):
                    key = (s.pid, addr, when, depth == 0)
                    found = located.get(key, _UNSEEN)
                    if found is _UNSEEN:
                        found = self._locate(key, idx, s.time_ns)
                    if found is None:
                        break  # the chain broke here (see _user_frames): nothing rootward is a real frame
                    hits.append(found)
                broken = len(hits) < len(s.user)
                sig = (broken, tuple([(m.path, m.build_id, off) for m, off in hits]))
                resolution = self._resolutions.setdefault(sig, len(self._resolutions))
                chain = chains[(s.pid, s.user, when)] = _Chain(hits, broken, resolution)
            out.append(chain)
        return out

    def address(self, pid: int, addr: int, time_ns: int) -> tuple[Mapping, int] | None:
        """Where `addr` (not a return address) lay in `pid` at `time_ns`: (mapping, file offset); None: nowhere."""
        idx = self.index.get(pid)
        key = (pid, addr, idx.epoch(time_ns) if idx else 0, True)
        found = self._located.get(key, _UNSEEN)
        return self._locate(key, idx, time_ns) if found is _UNSEEN else found

    def _locate(self, key: tuple[int, int, int, bool], idx: _ProcessIndex | None,
                time_ns: int) -> tuple[Mapping, int] | None:
        _, addr, _, leaf = key
        m = idx.find(addr, time_ns) if idx else None
        found: tuple[Mapping, int] | None = None
        if m is not None and not m.path.startswith("/"):
            found = (m, 0)
        elif m is not None:
            found = (m, addr - m.start + m.file_offset - (0 if leaf else 1))
            self.wanted[(m.path, m.build_id)].add(found[1])
        self._located[key] = found
        return found


_T = TypeVar("_T", RawSample, RawEvent)


class _StackBuilder:
    """The stacks of samples and events, root -> leaf: the process (and thread) roots, the user frames merged with
    the Python frames as the options ask, then a sample's kernel frames.

    A busy loop repeats a handful of raw stacks thousands of times: each distinct one is built once, so equal
    samples share one Stack object (exporters cache labels by its id), and the counters its merge added are
    replayed into `counters` each time. A key holds all a build reads: the chain's resolution stands for the user
    addresses and the snapshot in force, the code epoch for the time Python frames are named at."""

    def __init__(self, opts: StackOptions, names: dict[tuple[str, str], dict[int, Frame]], comms: dict[int, str],
                 kernel_symbols: dict[int, str], pynames: PythonNames, counters: dict[str, int]) -> None:
        self.opts = opts
        self.names = names  # (path, build id) -> file offset -> frame
        self.comms = comms  # pid -> the command its snapshots name
        self.kernel_symbols = kernel_symbols  # kernel address -> name
        self.pynames = pynames
        self.counters = counters
        self.kcache: dict[int, Frame] = {}
        self._who = opts.group in ("process", "thread")
        self._thread = opts.group == "thread"
        self._samples: dict[tuple[object, ...] | None, tuple[Stack, dict[str, int]]] = {}
        self._events: dict[tuple[object, ...] | None, tuple[Stack, dict[str, int]]] = {}

    def add_samples(self, prof: Profile, samples: list[RawSample], chains: list[_Chain]) -> None:
        """Each sample with its stack into `prof`: on CPU, or blocked (off CPU) with how long. (`event`'s
        memoized build written out, with names bound once: this runs for every sample of the capture.)"""
        memo, build, counters, epoch, comms = self._samples, self._sample, self.counters, self.pynames.epoch, self.comms
        who, thread, dedupe = self._who, self._thread, _DEDUPE
        for s, chain in zip(samples, chains, strict=True):
            key = (s.pid, chain.resolution, s.kern, tuple(map(_PY_FIELDS, s.py)), s.py_flags, s.user_err != 0,
                   stop_of(s.unwind), epoch(s.pid, s.time_ns) if s.py else 0,
                   (comms.get(s.pid) or s.comm) if who else "", (s.comm, s.tid) if thread else None,
                   s.off_cpu_ns != 0) if dedupe else None
            stack, delta = memo.get(key) or self._build(memo, key, build, s, chain)
            for k, v in delta.items():
                counters[k] = counters.get(k, 0) + v
            if s.off_cpu_ns:
                prof.off_cpu.append(Sample(stack, s.off_cpu_ns, s.pid, s.tid, s.comm, s.cpu, s.time_ns))
            else:
                prof.samples.append(Sample(stack, s.weight, s.pid, s.tid, s.comm, s.cpu, s.time_ns))

    def event(self, e: RawEvent, chain: _Chain) -> Stack:
        key = (e.pid, chain.resolution, tuple(map(_PY_FIELDS, e.py)), e.py_flags, e.user_err != 0,
               self.pynames.epoch(e.pid, e.time_ns) if e.py else 0, self.comms.get(e.pid) if self._who else "",
               e.tid if self._thread else None) if _DEDUPE else None
        stack, delta = self._events.get(key) or self._build(self._events, key, self._event, e, chain)
        if delta:
            self._replay(delta)
        return stack

    @staticmethod
    def _build(memo: dict[tuple[object, ...] | None, tuple[Stack, dict[str, int]]], key: tuple[object, ...] | None,
               build: Callable[[_T, _Chain, dict[str, int]], Stack], s: _T, chain: _Chain
               ) -> tuple[Stack, dict[str, int]]:
        """A stack not built yet (`key` None: not to be kept), and the counters its build added."""
        delta: dict[str, int] = {}
        hit = (build(s, chain, delta), delta)
        if key is not None:
            memo[key] = hit
        return hit

    def _replay(self, delta: dict[str, int]) -> None:
        counters = self.counters
        for k, v in delta.items():
            counters[k] = counters.get(k, 0) + v

    def _sample(self, s: RawSample, chain: _Chain, counters: dict[str, int]) -> Stack:
        frames = self._roots(s.pid, s.comm, s.tid)
        user = self._user(s, chain, counters, frames, s.unwind, bool(s.kern))
        if self.opts.kernel:
            kcache = self.kcache
            for addr in reversed(s.kern):
                f = kcache.get(addr)
                if f is None:
                    name = self.kernel_symbols.get(addr)
                    f = Frame(name, FrameKind.KERNEL, module="[kernel]") if name else UNKNOWN_KERNEL
                    kcache[addr] = f
                frames.append(f)
        if s.off_cpu_ns:  # where it blocked: the leaf says on what
            return with_marker(tuple(frames), user)
        return tuple(frames)

    def _event(self, e: RawEvent, chain: _Chain, counters: dict[str, int]) -> Stack:
        # An event names no command (its process's snapshots do), has no kernel stack, and no word of the CFI walk.
        frames = self._roots(e.pid, "", e.tid)
        self._user(e, chain, counters, frames, 0, False)
        return tuple(frames)

    def _roots(self, pid: int, comm: str, tid: int) -> list[Frame]:
        frames: list[Frame] = []
        if self._who:
            frames.append(Frame(self.comms.get(pid) or comm or str(pid), FrameKind.PROCESS))
        if self._thread:
            frames.append(Frame(f"{comm} [{tid}]", FrameKind.PROCESS))
        return frames

    def _user(self, s: ThreadStack, chain: _Chain, counters: dict[str, int], frames: list[Frame], unwind: int,
              in_kernel: bool) -> list[Frame]:
        """Appends the user frames to `frames` as the options ask (Python frames merged in, or alone); returns the
        native ones. `unwind`: how the walk ended (0: unknown); `in_kernel`: taken in the kernel (a kernel stack)."""
        opts = self.opts
        if not opts.user:
            return []
        user = _user_frames(s, chain, self.names, in_kernel)
        if s.py and s.py_flags & PyFlag.TSTATE and opts.python != "native":
            frames.extend(self.pynames.merged(s, user, counters, unwind, python_only=opts.python == "python",
                                              fold=not opts.native_interp))
        elif opts.python != "python":
            frames.extend(user)
        return user


def _outermost_file(idx: _ProcessIndex | None, s: RawSample) -> str:
    """The file of the last user frame a walk reached ("" when it lies in no mapping)."""
    m = idx.find(s.user[-1], s.time_ns) if idx and s.user else None
    return m.path if m else ""


@dataclass(slots=True)
class _Chain:
    """A user stack located in one snapshot epoch: the (mapping, file offset) of each frame up to where it broke."""

    hits: list[tuple[Mapping, int]]
    broken: bool  # an address rootward of `hits` is in no mapping
    resolution: int  # equal for chains that name alike


def _user_frames(s: ThreadStack, chain: _Chain, names: dict[tuple[str, str], dict[int, Frame]],
                 in_kernel: bool) -> list[Frame]:
    if not s.user:
        # Taken in the kernel on behalf of a thread with no user stack (or a failed lookup).
        return [MISSING_USER] if s.user_err or not in_kernel else []
    # Leaf first: an address in no executable mapping cannot be a return address, so the frame-pointer chain
    # broke there (code built without frame pointers) and every frame rootward of it came from the broken
    # chain. One `[unwind stopped]` stands for them instead of up to a hundred garbage frames.
    out: list[Frame] = [BROKEN_CHAIN] if chain.broken else []
    for m, off in reversed(chain.hits):  # _frame_at written out: this runs for every frame of every stack built
        if not m.path.startswith("/"):
            label = m.path if m.path.startswith("[") else ANON  # [vdso], [anon:name] (a named region), ...
            out.append(Frame(label, FrameKind.UNKNOWN, module=label))
            continue
        f = names.get((m.path, m.build_id), {}).get(off)
        if f is None:
            module = os.path.basename(m.path)
            f = Frame(offset_name(module, off), FrameKind.UNKNOWN, module=module)
        out.append(f)
    return out


def _frame_at(m: Mapping, off: int, names: dict[tuple[str, str], dict[int, Frame]]) -> Frame:
    """The frame at file offset `off` of `m` (`m.path` a file), or named after a mapping of no file (as each
    frame of `_user_frames`)."""
    if not m.path.startswith("/"):
        label = m.path if m.path.startswith("[") else ANON  # [vdso], [anon:name] (a named region), ...
        return Frame(label, FrameKind.UNKNOWN, module=label)
    f = names.get((m.path, m.build_id), {}).get(off)
    if f is None:
        module = os.path.basename(m.path)
        f = Frame(offset_name(module, off), FrameKind.UNKNOWN, module=module)
    return f

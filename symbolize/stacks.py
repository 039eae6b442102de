"""Turn a raw capture into the model: map addresses to modules, name them, and build root -> leaf stacks."""

from __future__ import annotations

import bisect
import itertools
import operator
import os
from collections import defaultdict
from dataclasses import dataclass

from aiflame.core.model import Frame, FrameKind, Profile, Sample, Stack
from aiflame.core.raw import Capture, Mapping, ProcessSnapshot, PyCode, PyFlag, RawPyFrame, RawSample
from aiflame.core.unwind import END as UNWIND_END
from aiflame.core.unwind import stop_of
from aiflame.symbolize.events import trace_events
from aiflame.symbolize.native import NativeSymbolizer, offset_name
from aiflame.symbolize.offcpu import with_marker
from aiflame.symbolize.python.code import line_for
from aiflame.symbolize.python.merge import fold_interpreter, merge, python_runs
from aiflame.symbolize.unwind_report import unwind_report

TRUNCATED = Frame("[truncated python stack]", FrameKind.UNKNOWN)

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
    where the frame chain broke, what lies rootward of it is one `[unwind stopped]`."""
    opts = options or StackOptions()
    native = native or NativeSymbolizer()
    by_pid: dict[int, list[ProcessSnapshot]] = defaultdict(list)
    for snap in cap.processes:
        by_pid[snap.pid].append(snap)
    index = {pid: _ProcessIndex(snaps) for pid, snaps in by_pid.items()}

    # Runtime events get their stacks the same way: each becomes a pseudo-sample (and so does the host
    # address naming its kernel, as a one-frame stack).
    event_raws = [RawSample(e.start_ns, e.pid, e.tid, -1, "", e.user, (), user_err=e.user_err, py=e.py,
                            py_flags=e.py_flags) for e in cap.events]
    func_raws = [RawSample(e.start_ns, e.pid, e.tid, -1, "", (e.args["func"],), ())
                 for e in cap.events if e.args.get("func")]
    raws = [*cap.samples, *event_raws, *func_raws]
    raw_chains, wanted = _locate(raws, index)
    names: dict[tuple[str, str], dict[int, Frame]] = {}
    for (path, build_id), offsets in wanted.items():
        names[(path, build_id)] = native.symbolize(path, build_id or None, offsets)

    prof = Profile(unit="samples", meta={"host": cap.header.host, "kernel": cap.header.kernel,
                                         "target": cap.header.target,
                                         "frequency_hz": str(cap.header.frequency_hz),
                                         # the clock pair and boot, to join captures of several hosts
                                         "start_wall_ns": str(cap.header.start_wall_ns),
                                         "boot_id": cap.header.meta.get("boot_id", "")})
    builder = _StackBuilder(cap, opts, names, {pid: idx.comm for pid, idx in index.items()})
    event_stacks = _add_stacks(prof, raws, raw_chains, builder, len(cap.samples), len(event_raws))
    stops, worst = unwind_report((s for s in cap.samples if not s.off_cpu_ns),
                                 lambda s: _outermost_file(index.get(s.pid), s))
    prof.counters.update(stops)
    if worst:
        prof.meta["unwind_worst"] = worst
    n_ev = len(event_raws)
    prof.events = trace_events(cap, event_stacks[:n_ev], [st[-1] if st else None for st in event_stacks[n_ev:]])
    if cap.footer:
        for k, v in cap.footer.counters.items():
            prof.counters[k] = prof.counters.get(k, 0) + v
        prof.start_ns, prof.end_ns = cap.header.start_mono_ns, cap.footer.end_mono_ns
    return prof


def _locate(raws: list[RawSample], index: dict[int, _ProcessIndex]
            ) -> tuple[list[_Chain], dict[tuple[str, str], set[int]]]:
    """Pass 1: each raw's user chain located (mapping, file offset per frame), and the file offsets each module
    (path, build id) needs named.

    Each distinct chain is located once per snapshot epoch (samples between the same two snapshots locate alike).
    Return addresses (all but the leaf) point after the call; look up addr - 1 so the frame names the calling
    function and line. Chains that locate alike (the same addresses in another epoch, mapped the same) share a
    resolution id."""
    located: dict[tuple[int, int, int, bool], tuple[Mapping, int] | None] = {}
    chains: dict[tuple[int, tuple[int, ...], int], _Chain] = {}
    resolutions: dict[tuple[bool, tuple[tuple[str, str, int], ...]], int] = {}
    wanted: dict[tuple[str, str], set[int]] = defaultdict(set)
    raw_chains: list[_Chain] = []
    for s in raws:
        idx = index.get(s.pid)
        when = idx.epoch(s.time_ns) if idx else 0
        chain = chains.get((s.pid, s.user, when))
        if chain is None:
            hits: list[tuple[Mapping, int]] = []
            for depth, addr in enumerate(s.user):
                key = (s.pid, addr, when, depth == 0)
                found = located.get(key, _UNSEEN)
                if found is _UNSEEN:
                    m = idx.find(addr, s.time_ns) if idx else None
                    if m is None:
                        found = None
                    elif not m.path.startswith("/"):
                        found = (m, 0)
                    else:
                        off = addr - m.start + m.file_offset - (1 if depth else 0)
                        found = (m, off)
                        wanted[(m.path, m.build_id)].add(off)
                    located[key] = found
                if found is None:
                    break  # the chain broke here (see _user_frames): nothing rootward is a real frame
                hits.append(found)
            broken = len(hits) < len(s.user)
            sig = (broken, tuple([(m.path, m.build_id, off) for m, off in hits]))
            chain = chains[(s.pid, s.user, when)] = _Chain(hits, broken, resolutions.setdefault(sig, len(resolutions)))
        raw_chains.append(chain)
    return raw_chains, wanted


def _add_stacks(prof: Profile, raws: list[RawSample], raw_chains: list[_Chain], builder: _StackBuilder,
                n_samples: int, n_events: int) -> list[Stack]:
    """Pass 2: the stack of every raw. The first `n_samples` raws (the capture's samples) go into `prof`, with the
    counters their merge added; the stacks of the rest (the events' pseudo-samples) are returned in order."""
    # A busy loop repeats a handful of raw stacks thousands of times: build each distinct one once, so equal
    # samples share one Stack object (exporters cache labels by its id), and replay the counters its merge added.
    # The key holds all `build` reads: the chain's resolution stands for the user addresses and the snapshot in
    # force, the code epoch for the time Python frames are named at.
    build, pynames, comms, names = builder.build, builder.pynames, builder.comms, builder.names
    who = builder.opts.group in ("process", "thread")
    thread = builder.opts.group == "thread"
    memo: dict[tuple[object, ...], tuple[Stack, dict[str, int]]] = {}
    event_stacks: list[Stack] = []
    for n, (s, chain) in enumerate(zip(raws, raw_chains, strict=True)):
        if n >= n_samples + n_events:  # a kernel's host address: its frame alone
            event_stacks.append(tuple(_user_frames(s, chain, names)))
            continue
        raw_key: tuple[object, ...] | None = None
        hit = None
        if _DEDUPE:
            raw_key = (s.pid, chain.resolution, s.kern, tuple(map(_PY_FIELDS, s.py)), s.py_flags, s.user_err != 0,
                       stop_of(s.unwind),
                       pynames.epoch(s.pid, s.time_ns) if s.py else 0,
                       (comms.get(s.pid) or s.comm) if who else "", (s.comm, s.tid) if thread else None,
                       s.off_cpu_ns != 0)
            hit = memo.get(raw_key)
        if hit is None:
            delta: dict[str, int] = {}
            hit = (build(s, chain, delta), delta)
            if raw_key is not None:
                memo[raw_key] = hit
        stack, delta = hit
        for k, v in delta.items():
            prof.counters[k] = prof.counters.get(k, 0) + v
        if n < n_samples:
            if s.off_cpu_ns:
                prof.off_cpu.append(Sample(stack, s.off_cpu_ns, s.pid, s.tid, s.comm, s.cpu, s.time_ns))
            else:
                prof.samples.append(Sample(stack, s.weight, s.pid, s.tid, s.comm, s.cpu, s.time_ns))
        else:
            event_stacks.append(stack)
    return event_stacks


class _StackBuilder:
    """Builds one raw sample's stack, root -> leaf: the process (and thread) roots, the user frames merged with
    the Python frames as the options ask, then the kernel frames."""

    def __init__(self, cap: Capture, opts: StackOptions, names: dict[tuple[str, str], dict[int, Frame]],
                 comms: dict[int, str]) -> None:
        self.cap = cap
        self.opts = opts
        self.names = names  # (path, build id) -> file offset -> frame
        self.comms = comms  # pid -> the command its snapshots name
        self.pynames = _PythonNames(cap)
        self.kcache: dict[int, Frame] = {}

    def build(self, s: RawSample, chain: _Chain, counters: dict[str, int]) -> Stack:
        opts = self.opts
        frames: list[Frame] = []
        if opts.group in ("process", "thread"):
            frames.append(Frame(self.comms.get(s.pid) or s.comm or str(s.pid), FrameKind.PROCESS))
        if opts.group == "thread":
            frames.append(Frame(f"{s.comm} [{s.tid}]", FrameKind.PROCESS))
        user: list[Frame] = []
        if opts.user:
            user = _user_frames(s, chain, self.names)
            if s.py and s.py_flags & PyFlag.TSTATE and opts.python != "native":
                frames.extend(self.pynames.merged(s, user, counters, python_only=opts.python == "python",
                                                  fold=not opts.native_interp))
            elif opts.python != "python":
                frames.extend(user)
        if opts.kernel:
            kcache = self.kcache
            for addr in reversed(s.kern):
                f = kcache.get(addr)
                if f is None:
                    name = self.cap.kernel_symbols.get(addr)
                    f = Frame(name, FrameKind.KERNEL, module="[kernel]") if name else UNKNOWN_KERNEL
                    kcache[addr] = f
                frames.append(f)
        if s.off_cpu_ns:  # where it blocked: the leaf says on what
            return with_marker(tuple(frames), user)
        return tuple(frames)


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


def _user_frames(s: RawSample, chain: _Chain, names: dict[tuple[str, str], dict[int, Frame]]) -> list[Frame]:
    if not s.user:
        # A sample taken in the kernel on behalf of a thread with no user stack (or a failed lookup).
        return [MISSING_USER] if s.user_err or not s.kern else []
    # Leaf first: an address in no executable mapping cannot be a return address, so the frame-pointer chain
    # broke there (code built without frame pointers) and every frame rootward of it came from the broken
    # chain. One `[unwind stopped]` stands for them instead of up to a hundred garbage frames.
    out: list[Frame] = [BROKEN_CHAIN] if chain.broken else []
    for m, off in reversed(chain.hits):
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


class _PythonNames:
    """Names Python frames from the code objects the capture recorded, and merges them with native frames."""

    def __init__(self, cap: Capture) -> None:
        from aiflame.core.python_layouts import layout_for

        self.codes: dict[tuple[int, int], list[PyCode]] = defaultdict(list)
        for c in cap.py_codes:
            self.codes[(c.pid, c.addr)].append(c)
        # Per pid, when an address got its 2nd, 3rd... code object: names depend on a sample's time only by
        # how many of these precede it.
        changes: dict[int, list[int]] = defaultdict(list)
        for (pid, _), lst in self.codes.items():
            lst.sort(key=lambda c: c.time_ns)
            changes[pid].extend(c.time_ns for c in lst[1:])
        self._changes = {pid: sorted(times) for pid, times in changes.items() if times}
        self.version: dict[int, tuple[int, int]] = {}
        self.owner_cstack: dict[int, int] = {}
        self.interpreter: dict[int, str] = {}  # the module (Frame.module) of the ELF file running the interpreter
        for r in cap.py_runtimes:
            self.interpreter[r.pid] = os.path.basename(r.binary.removesuffix(" (deleted)"))
            parts = r.version.split(".")
            v = (int(parts[0]), int(parts[1]))
            self.version[r.pid] = v
            lay = layout_for(v)
            self.owner_cstack[r.pid] = lay.owner_cstack if lay else -1
        self._frames: dict[tuple[int, int, int, int], Frame] = {}

    def epoch(self, pid: int, time_ns: int) -> int:
        """How many code-object replacements in `pid` precede `time_ns`; `frame` depends on time only by this."""
        times = self._changes.get(pid)
        return bisect.bisect_right(times, time_ns) if times else 0

    def frame(self, pid: int, f: RawPyFrame, time_ns: int) -> Frame:
        cands = self.codes.get((pid, f.code))
        if not cands:
            return Frame("[unknown python]", FrameKind.PYTHON)
        # The record in force at the sample's time (an address can be reused by a later code object).
        code = cands[0]
        for c in cands:
            if c.time_ns <= time_ns:
                code = c
        key = (pid, f.code, code.time_ns, f.instr)
        hit = self._frames.get(key)
        if hit is None:
            info = code.info
            hit = Frame(info.qualname, FrameKind.PYTHON, module=os.path.basename(info.filename), file=info.filename,
                        line=line_for(info, f.instr))
            self._frames[key] = hit
        return hit

    def merged(self, s: RawSample, native: list[Frame], counters: dict[str, int], python_only: bool,
               fold: bool = True) -> list[Frame]:
        version = self.version.get(s.pid)
        if version is None:
            return native
        runs = python_runs(s.py, version, self.owner_cstack.get(s.pid, -1))
        def name(f: RawPyFrame) -> Frame:
            return self.frame(s.pid, f, s.time_ns)
        trunc = [TRUNCATED] if s.py_flags & PyFlag.TRUNCATED else []
        if python_only:
            return trunc + [name(f) for run in runs for f in run]
        # the CFI walker's own word on whether it reached the outermost frame; other walks are judged by name
        stop = stop_of(s.unwind)
        complete = stop == UNWIND_END if stop else None
        result = merge(native, runs, name, complete)
        counters["python_samples"] = counters.get("python_samples", 0) + 1
        if result.spliced:
            counters["python_spliced"] = counters.get("python_spliced", 0) + 1
        if result.mismatched:
            counters["python_mismatched"] = counters.get("python_mismatched", 0) + 1
        stack = fold_interpreter(result.stack, self.interpreter.get(s.pid, "")) if fold else result.stack
        return trunc + list(stack)

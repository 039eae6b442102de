"""On-demand captures (`aiflame trigger`): a request is checked against the configured limits on the control
thread and queued; the main loop runs it beside the continuous collector, one at a time, in steps that never
hold the loop up: the high-resolution sampler compiles on a helper thread, then the capture opens, is ticked,
and closes after its duration or when its targets have exited; the export worker finishes it, and its client
gets the answer."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from aiflame.agent.daemon.collector import WindowResult
from aiflame.agent.daemon.config import DaemonConfig
from aiflame.agent.daemon.exports import ExportJob
from aiflame.agent.daemon.protocol import Response, TriggerRequest
from aiflame.agent.daemon.rolling import ExportSink
from aiflame.agent.daemon.store import OutputDirs
from aiflame.agent.procs import alive

log = logging.getLogger("aiflame.daemon")

ANSWER_GRACE_S = 120.0  # a client waits this much beyond the capture's duration for its answer
MAX_AT_S = 24 * 3600.0  # how far ahead `trigger --at` may name its start
AT_SLEEP_S = 0.25  # a start this close is slept for in the main loop, to the instant (its ticks are 0.1 s apart)


class CaptureSource(Protocol):
    """What records a capture (agent.daemon.collector.Collector)."""

    exited: list[int]

    @property
    def targets(self) -> list[int]: ...

    def start(self) -> None: ...

    def open_window(self, path: Path, target: str = "") -> None: ...

    def add_target(self, pid: int) -> bool: ...

    def tick(self, timeout_s: float) -> None: ...

    def close_window(self, stop_reason: str) -> WindowResult: ...

    def close(self) -> None: ...


@dataclass
class Capture:
    """An on-demand capture: requested by a client, run by the main loop, answered when finished."""

    seq: int
    req: TriggerRequest
    pids: list[int]
    duration_s: float
    frequency: int
    reply: Response | None = None
    done: threading.Event = field(default_factory=threading.Event)
    collector: CaptureSource | None = None
    compile_error: str = ""
    compiled: threading.Event = field(default_factory=threading.Event)
    partial: Path | None = None
    deadline: float = 0.0
    started_wall_ns: int = 0  # CLOCK_REALTIME when the window opened

    @property
    def name(self) -> str:
        return f"c{self.seq:04d}"


class Captures:
    """The queue of on-demand captures and the one running.

    `new_source(capture)` makes the capture's collector (not started); `watched()` lists the watched pids (for
    `--all`); `exists(pid)` says whether a pid may be captured; `on_exits(pids)` hears of the exits a capture's
    collector saw (and empties the list); `wake()` ends the main loop's wait.
    """

    def __init__(self, cfg: DaemonConfig, out: OutputDirs, exports: ExportSink,
                 new_source: Callable[[Capture], CaptureSource], watched: Callable[[], list[int]],
                 exists: Callable[[int], bool], on_exits: Callable[[list[int]], None],
                 wake: Callable[[], None]) -> None:
        self.cfg = cfg
        self.out = out
        self.exports = exports
        self.written = 0
        self._new_source = new_source
        self._watched = watched
        self._exists = exists
        self._on_exits = on_exits
        self._wake = wake
        self._queue: queue.Queue[Capture] = queue.Queue()
        self._current: Capture | None = None
        self._seq = 0

    @property
    def running(self) -> bool:
        return self._current is not None

    def reconfigure(self, cfg: DaemonConfig, out: OutputDirs) -> None:
        self.cfg, self.out = cfg, out

    # --- control thread -------------------------------------------------------------------------------------

    def request(self, req: TriggerRequest) -> Response:
        """Check `req`, queue it and wait until the main loop has run it."""
        tc = self.cfg.trigger
        duration = tc.default_duration_s if req.duration_s is None else req.duration_s
        freq = tc.default_frequency if req.frequency is None else req.frequency
        if duration > tc.max_duration_s:
            return Response(False, f"duration {duration:g} s exceeds the configured maximum ({tc.max_duration_s:g} s)")
        if freq > tc.max_frequency:
            return Response(False, f"frequency {freq} Hz exceeds the configured maximum ({tc.max_frequency} Hz)")
        if req.all_targets:
            pids = sorted(self._watched())
            if not pids:
                return Response(False, "no watched processes to capture")
        else:
            pids = list(req.pids)
            for pid in pids:
                if not self._exists(pid):
                    return Response(False, f"no such process: {pid}")
        ahead = 0.0
        if req.at_wall_ns is not None:
            ahead = (req.at_wall_ns - time.time_ns()) / 1e9
            if ahead < 0:
                return Response(False, f"the start asked for passed {-ahead:.3f} s ago (--at names a time to come)")
            if ahead > MAX_AT_S:
                return Response(False, f"the start asked for is {ahead:.0f} s ahead (at most {MAX_AT_S:.0f} s)")
        if self._current is not None or not self._queue.empty():
            return Response(False, "busy: another capture is running; try again when it is done")
        self._seq += 1
        c = Capture(self._seq, req, pids, duration, freq)
        self._queue.put(c)
        self._wake()
        if not c.done.wait(ahead + duration + ANSWER_GRACE_S):
            return Response(False, "the capture did not finish in time")
        assert c.reply is not None
        return c.reply

    # --- main loop ------------------------------------------------------------------------------------------

    def step(self) -> None:
        """Move the capture in progress on by one step (or start the next one queued)."""
        c = self._current
        if c is None:
            try:
                c = self._queue.get_nowait()
            except queue.Empty:
                return
            self._compile(c)
            return
        if not c.compiled.is_set():
            return
        if c.collector is None or c.compile_error:
            self._answer(c, Response(False, f"cannot start the capture: {c.compile_error}"))
            return
        if c.partial is None:
            if c.req.at_wall_ns is not None:  # loaded first, then started at the instant named (trigger --at)
                wait = (c.req.at_wall_ns - time.time_ns()) / 1e9
                if wait > AT_SLEEP_S:
                    return
                if wait > 0:
                    time.sleep(wait)
            self._begin(c)
            return
        c.collector.tick(0)
        self._on_exits(c.collector.exited)
        if time.monotonic() >= c.deadline or not any(alive(p) for p in c.collector.targets):
            self.finish("duration" if time.monotonic() >= c.deadline else "targets exited")

    def _compile(self, c: Capture) -> None:
        """Compile the high-resolution sampler on a helper thread (BCC releases the GIL while it compiles)."""
        self._current = c
        source = self._new_source(c)

        def compile_it() -> None:
            try:
                source.start()
                c.collector = source
            except Exception as e:
                c.compile_error = str(e)
                source.close()
            c.compiled.set()

        threading.Thread(target=compile_it, name="aiflame-compile", daemon=True).start()
        log.info("capture requested id=%s pids=%s duration_s=%g frequency=%d", c.name,
                 ",".join(map(str, c.pids)), c.duration_s, c.frequency)

    def _begin(self, c: Capture) -> None:
        assert c.collector is not None
        c.started_wall_ns = time.time_ns()
        c.partial = self.out.new_capture(time.time(), c.seq)
        c.collector.open_window(c.partial / "profile.aiflame", target="pids " + ",".join(map(str, c.pids)))
        for pid in c.pids:
            c.collector.add_target(pid)
        c.deadline = time.monotonic() + c.duration_s
        log.info("capture started id=%s targets=%d", c.name, len(c.collector.targets))

    def finish(self, reason: str) -> None:
        """End the capture in progress (if any) now and hand it to the export worker; cancel one not started."""
        c = self._current
        if c is None:
            return
        if c.collector is None or c.partial is None:
            if c.collector:
                c.collector.close()
            self._answer(c, Response(False, f"capture cancelled: {reason}"))
            return
        result = c.collector.close_window(reason)
        c.collector.close()
        for w in result.warnings:
            log.warning("capture %s: %s", c.name, w)
        self.written += 1
        log.info("capture closed id=%s samples=%d events=%d reason=%s", c.name, result.samples, result.events,
                 reason.replace(" ", "-"))
        formats = tuple(dict.fromkeys([*self.cfg.output.formats, "folded", "svg",
                                       *(["chakra"] if c.req.chakra else [])]))

        def done(final: Path, files: list[Path], notes: list[str]) -> None:
            self.out.prune_captures(self.cfg.retention.keep_captures)
            self._answer(c, Response(True, data={
                "dir": str(final), "capture": str(final / "profile.aiflame"), "files": [str(f) for f in files],
                "samples": result.samples, "events": result.events, "lost": result.counters.get("lost", 0),
                "pids": c.pids, "stop_reason": reason, "notes": notes, "started_ns": c.started_wall_ns,
            }))

        self.exports.submit(ExportJob(c.partial, formats, f"aiflame capture {c.name}", done=done), block=True)
        self._current = None

    def fail_queued(self, why: str) -> None:
        """Answer every capture still queued with `why`."""
        while True:
            try:
                c = self._queue.get_nowait()
            except queue.Empty:
                return
            self._answer(c, Response(False, why))

    def abort(self) -> None:
        """The daemon is going down without finishing: release the running capture's collector."""
        c = self._current
        if c is not None and c.collector is not None:
            c.collector.close()

    def _answer(self, c: Capture, resp: Response) -> None:
        c.reply = resp
        c.done.set()
        if self._current is c:
            self._current = None

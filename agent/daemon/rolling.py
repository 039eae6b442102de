"""The continuous collector's rolling windows: one capture file per `window_s`. A window closes when its time is
up (the main loop asks `due`), at a reload that changes what is sampled or where it goes, and when the daemon
stops. A closed window that holds nothing is dropped (no empty windows pile up on an idle host); any other goes
to the export worker, and once it is published the retention limits are applied."""

from __future__ import annotations

import itertools
import logging
import shutil
import time
from pathlib import Path
from typing import Protocol

from aiflame.agent.daemon.collector import WindowResult
from aiflame.agent.daemon.config import DaemonConfig
from aiflame.agent.daemon.exports import ExportJob
from aiflame.agent.daemon.store import PARTIAL_PREFIX, OutputDirs

log = logging.getLogger("aiflame.daemon")


class WindowSource(Protocol):
    """What writes a window's capture file (agent.daemon.collector.Collector)."""

    def open_window(self, path: Path, target: str = "") -> None: ...

    def close_window(self, stop_reason: str) -> WindowResult: ...


class ExportSink(Protocol):
    """What finishes a closed window (agent.daemon.exports.ExportWorker)."""

    def submit(self, job: ExportJob, block: bool = False) -> None: ...


class RollingWindows:
    """Opens, closes and rotates the windows of one source at a time; counts what they held."""

    def __init__(self, cfg: DaemonConfig, out: OutputDirs, exports: ExportSink) -> None:
        self.cfg = cfg
        self.out = out
        self.exports = exports
        self.end = 0.0  # when the open window is due to close (time.monotonic)
        self.written = 0
        self.samples = 0  # in the windows written
        self.lost: dict[str, int] = {}  # the windows' counters (lost records and the like), summed
        self._seq = itertools.count()
        self._source: WindowSource | None = None
        self._partial: Path | None = None

    def open(self, source: WindowSource) -> None:
        """Start a window of `source` now."""
        assert self._partial is None
        self._partial = self.out.new_window(time.time(), self._seq)
        source.open_window(self._partial / "profile.aiflame")
        self._source = source
        self.end = time.monotonic() + self.cfg.continuous.window_s

    def due(self, now: float) -> bool:
        return now >= self.end

    def close(self, reason: str) -> None:
        """Close the open window (if any) and hand it on; `reason` goes into its footer."""
        partial, source = self._partial, self._source
        if partial is None or source is None:
            return
        self._partial = None
        result = source.close_window(reason)
        for w in result.warnings:
            log.warning("collector: %s", w)
        if not result.samples and not result.events and not result.pids:
            shutil.rmtree(partial, ignore_errors=True)  # nothing watched: no empty windows pile up
            return
        self.written += 1
        self.samples += result.samples
        for k, v in result.counters.items():
            self.lost[k] = self.lost.get(k, 0) + v
        log.info("window closed dir=%s samples=%d events=%d lost=%d targets=%d reason=%s",
                 partial.name[len(PARTIAL_PREFIX):], result.samples, result.events,
                 result.counters.get("lost", 0), len(result.pids), reason.replace(" ", "-"))
        # A rotation may skip the export when the worker is behind; a last window (reload, stop) waits for it.
        self.exports.submit(ExportJob(partial, self.cfg.output.formats, "aiflame window", done=self._published),
                            block=reason != "window end")

    def rotate(self, reason: str = "window end") -> None:
        """Close the open window and open the next of the same source."""
        source = self._source
        self.close(reason)
        if source is not None:
            self.open(source)

    def reconfigure(self, cfg: DaemonConfig, out: OutputDirs) -> None:
        """A reload: the open window's end moves with the new `window_s`; windows from now on follow `cfg` and
        go to `out` (the caller closes and reopens the window when what it samples changes)."""
        self.end += cfg.continuous.window_s - self.cfg.continuous.window_s
        self.cfg, self.out = cfg, out

    def _published(self, final: Path, _files: list[Path], notes: list[str]) -> None:
        """(Export thread) the window is visible: apply retention."""
        r = self.cfg.retention
        for d in self.out.prune_windows(time.time(), r.max_age_h * 3600, int(r.max_total_mb * (1 << 20))):
            log.info("retention deleted dir=%s", d.name)
        for n in notes:
            log.warning("window %s: %s", final.name, n)

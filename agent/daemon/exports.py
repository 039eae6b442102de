"""Finishing a window or capture off the sampling thread: symbolize its capture file, write the configured
exports next to it, and publish the directory (atomic rename). One worker thread with a bounded queue: when
symbolization falls behind, a window is published with its capture only (re-exportable later) instead of the
queue growing."""

from __future__ import annotations

import ctypes
import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from aiflame.agent.daemon.store import OutputDirs
from aiflame.exporters.write import write_views
from aiflame.symbolize.native import NativeSymbolizer
from aiflame.symbolize.road import open_capture, symbolizer

log = logging.getLogger("aiflame.daemon")
_libc = ctypes.CDLL(None)


def release_free_memory() -> None:
    """Give the heap's free pages back to the kernel (glibc malloc_trim: every arena, holes included). A window's
    symbolization peaks at tens of MB on this thread's arena; without this, fragmentation keeps the peak resident."""
    _libc.malloc_trim(0)


@dataclass
class ExportJob:
    partial_dir: Path  # holds profile.aiflame; renamed to its final name when done
    formats: tuple[str, ...]
    title: str
    done: Callable[[Path, list[Path], list[str]], None] | None = None  # (final dir, files, notes)
    notes: list[str] = field(default_factory=list)


def export_capture(capture: Path, formats: tuple[str, ...], title: str,
                   native: NativeSymbolizer) -> tuple[list[Path], list[str]]:
    """Write `formats` of `capture`'s views next to it (symbolize/road.py, exporters/write.py); "chakra" writes one
    `profile.<rank>.et` per rank."""
    opened = open_capture(capture, native=native)
    done = write_views(opened.views(), formats, capture.parent, svg_options=lambda v: {"title": f"{title} ({v.stem})"})
    return done.files, [*opened.warnings, *done.notes]


class ExportWorker:
    """The thread that finishes windows and captures, in order."""

    def __init__(self, max_queued: int) -> None:
        self._queue: queue.Queue[ExportJob | None] = queue.Queue(maxsize=max_queued)
        self._native = symbolizer()
        self._thread = threading.Thread(target=self._run, name="aiflame-export", daemon=True)
        self.skipped = 0
        self.failed = 0
        self._thread.start()

    def submit(self, job: ExportJob, block: bool = False) -> None:
        """Queue `job`; when the queue is full (and not `block`), publish the capture alone right away."""
        try:
            self._queue.put(job, block=block)
        except queue.Full:
            self.skipped += 1
            log.warning("export skipped (symbolization behind) dir=%s", job.partial_dir)
            self._publish(job, [], ["exports skipped: the daemon was behind"])

    @property
    def pending(self) -> int:
        return self._queue.qsize()

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            files: list[Path] = []
            notes = list(job.notes)
            try:
                files, more = export_capture(job.partial_dir / "profile.aiflame", job.formats, job.title, self._native)
                notes += more
            except Exception as e:  # never lose the capture over an export problem
                self.failed += 1
                notes.append(f"export failed: {e}")
                log.error("export failed dir=%s error=%s", job.partial_dir, e)
            self._publish(job, files, notes)
            release_free_memory()

    @staticmethod
    def _publish(job: ExportJob, files: list[Path], notes: list[str]) -> None:
        try:
            final = OutputDirs.publish(job.partial_dir)
        except OSError as e:
            log.error("cannot publish dir=%s error=%s", job.partial_dir, e.strerror)
            final = job.partial_dir
        moved = [final / f.name for f in files]
        if job.done:
            job.done(final, moved, notes)

    def stop(self, timeout_s: float) -> bool:
        """Finish the queued jobs (up to `timeout_s`); False when some were left unfinished."""
        try:
            self._queue.put(None, timeout=timeout_s)
        except queue.Full:
            return False
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

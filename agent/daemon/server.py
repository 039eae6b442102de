"""The daemon: one main thread runs the continuous collector (rolling windows), process discovery and any
on-demand capture; a control thread answers the root-only Unix socket; an export thread finishes windows.

`Daemon` composes parts that each do one job and are tested alone: discovery (agent.daemon.discovery), the
collector (agent.daemon.collector), rolling windows (agent.daemon.rolling), on-demand captures
(agent.daemon.captures), the capture store and retention (agent.daemon.store), the export worker
(agent.daemon.exports), the control socket (agent.daemon.control), status requests (agent.daemon.status) and
signals (agent.daemon.signals). What is left here is the main loop and what ties the parts together: which
processes the collector samples, a reload, and the status a client sees.

Signals: SIGTERM/SIGINT stop cleanly (the window in progress is closed complete and exported, a capture in
progress is finished and its client answered); SIGHUP re-reads the configuration (a bad file is logged and
the old configuration kept; the window in progress continues unless the sampling rate or probes changed, in
which case it is closed complete first).
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

from aiflame.agent.daemon.captures import Capture, Captures
from aiflame.agent.daemon.collector import Collector
from aiflame.agent.daemon.config import DaemonConfig, load_config
from aiflame.agent.daemon.control import ControlServer
from aiflame.agent.daemon.discovery import Discovery, Selector, process_info
from aiflame.agent.daemon.exports import ExportWorker
from aiflame.agent.daemon.protocol import LatestRequest, Request, Response, StatusRequest
from aiflame.agent.daemon.rolling import RollingWindows
from aiflame.agent.daemon.signals import LoopSignals, controlling_tty
from aiflame.agent.daemon.status import StatusBoard
from aiflame.agent.daemon.store import FILE_UMASK, OutputDirs
from aiflame.agent.kernel.sampler import SamplerConfig
from aiflame.agent.kernel.stop_watchdog import keep_watchdog_priority
from aiflame.agent.preflight import check_root, check_tracefs
from aiflame.agent.procs import own_cpu_s, own_rss_bytes
from aiflame.core.errors import HostError

__all__ = ["Daemon", "run_daemon", "setup_logging"]

log = logging.getLogger("aiflame.daemon")

# The main loop sleeps up to this long between drains (less when a fast rate on many CPUs could fill the ring
# sooner). Records that need the agent now (library opens), signals and control requests wake it at once.
POLL_S = 2.0
CAPTURE_POLL_S = 0.1  # while an on-demand capture runs: its targets may be stopped at a library open; while CFI
# tables build in the background: the drain stores them
MAX_STATUS_TARGETS = 200


def setup_logging(level: int = logging.INFO) -> None:
    """One line per event on stderr (journald keeps it): `LEVEL event key=value ...`."""
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s aiflame-agent %(levelname)s %(message)s"))
    root = logging.getLogger("aiflame.daemon")
    root.handlers[:] = [handler]
    root.setLevel(level)
    root.propagate = False


class Daemon:
    def __init__(self, cfg: DaemonConfig, config_path: Path | None = None) -> None:
        self.cfg = cfg
        self.config_path = config_path
        self.out = OutputDirs(cfg.output.dir)
        self.signals = LoopSignals()
        self.status = StatusBoard(self.signals.wake)
        self.discovery = Discovery(Selector(cfg.watch), exclude_pids=[os.getpid()])
        self.control = ControlServer(cfg.control.socket, self._handle, serving=lambda: not self.signals.stop_reason)
        self.exports: ExportWorker | None = None
        self.windows: RollingWindows | None = None
        self.captures: Captures | None = None
        self.collector: Collector | None = None
        self.too_many_targets = 0
        self._added: dict[int, int] = {}  # pid -> uid of the processes discovery added (what max_targets bounds)
        self._poll_s = POLL_S
        self._started = time.monotonic()
        self._cpu_start = own_cpu_s()

    # --- main -----------------------------------------------------------------------------------------------

    def run(self) -> int:
        check_root()
        check_tracefs()
        os.umask(FILE_UMASK)
        self._lower_priority()
        self._prepare_output()
        self.control.listen()
        with self.signals:
            self.exports = ExportWorker(self.cfg.limits.max_queued_exports)
            self.windows = RollingWindows(self.cfg, self.out, self.exports)
            self.captures = Captures(self.cfg, self.out, self.exports, self._capture_source,
                                     lambda: list(self.discovery.targets), self._may_capture, self._handle_exits,
                                     self.signals.wake)
            try:
                self.collector = self._new_collector()
                self.control.start()
                log.info("started pid=%d config=%s output=%s socket=%s frequency=%d window_s=%g", os.getpid(),
                         self.cfg.source, self.cfg.output.dir, self.cfg.control.socket,
                         self.cfg.continuous.frequency, self.cfg.continuous.window_s)
                self.windows.open(self.collector)
                self._loop()
                self._finish()
            finally:
                self.control.close()
                self.captures.abort()
                if self.collector:
                    self.collector.close()
        log.info("stopped reason=%s windows=%d captures=%d", self.signals.stop_reason, self.windows.written,
                 self.captures.written)
        return 0

    def _lower_priority(self) -> None:
        """Run at the configured niceness; stop watchdogs keep the priority we started with (the safety net that
        continues stopped targets must not wait behind a busy host; the unit has no CAP_SYS_NICE to undo it)."""
        keep_watchdog_priority()
        try:
            os.setpriority(os.PRIO_PROCESS, 0, self.cfg.limits.nice)  # this thread, and every thread it makes
        except OSError as e:
            log.warning("cannot set niceness %d: %s", self.cfg.limits.nice, e)

    def _prepare_output(self) -> None:
        try:
            notes = self.out.prepare()
        except OSError as e:
            raise HostError(f"cannot use output directory {self.out.root}: {e}") from None
        for note in notes:
            log.warning("%s", note)

    def _new_collector(self) -> Collector:
        c = self.cfg.continuous
        sampler = SamplerConfig(frequency=c.frequency, event="cpu-clock", max_targets=self.cfg.limits.max_targets * 8,
                                call_rate=c.launch_stacks)
        collector = Collector(sampler, c.runtimes, "continuous", self.cfg.limits.max_probed_libraries)
        t0 = time.monotonic()
        collector.start()
        log.info("sampler loaded frequency=%d runtimes=%s seconds=%.1f", c.frequency, c.runtimes,
                 time.monotonic() - t0)
        for pid in list(self.discovery.targets):
            collector.add_target(pid)
        collector.sampler.watch(self.signals.fd)
        self._poll_s = collector.drain_interval(POLL_S)
        return collector

    def _loop(self) -> None:
        assert self.collector is not None and self.windows is not None and self.captures is not None
        self.status.publish(self._status())
        next_scan = 0.0
        while not self.signals.stop_reason:
            now = time.monotonic()
            if now >= next_scan:
                self._scan()
                next_scan = now + self.cfg.watch.scan_interval_s
            building = self.collector.sampler.tables_building
            poll = CAPTURE_POLL_S if self.captures.running or building else self._poll_s
            wake_at = min(time.monotonic() + poll, next_scan, self.windows.end)
            self.collector.tick(max(wake_at - time.monotonic(), 0))
            self.signals.clear()
            self._handle_exits(self.collector.exited)
            self.captures.step()
            if self.signals.take_reload():
                self._reload()
            if self.windows.due(time.monotonic()):
                self.windows.rotate("window end")
            self.status.answer(self._status)

    def _finish(self) -> None:
        """Stop: close the window in progress complete, finish a capture in progress, wait for the exports."""
        assert self.windows is not None and self.captures is not None and self.exports is not None
        reason = f"daemon stopping ({self.signals.stop_reason})"
        self.captures.finish(reason)
        self.windows.close(reason)
        self.captures.fail_queued("the daemon is stopping")
        if not self.exports.stop(timeout_s=60):
            log.warning("exports unfinished at exit; the next start keeps them as incomplete")

    # --- which processes are sampled ------------------------------------------------------------------------

    def _scan(self) -> None:
        assert self.collector is not None
        new, gone = self.discovery.scan()
        limits = self.cfg.limits
        for pid in gone:  # its exit event is still in the ring buffer, or was lost
            log.info("target exited pid=%d", pid)
            self.collector.remove_target(pid)
            self._added.pop(pid, None)
        for info in new:
            if self.collector.samples(info.pid) or self.collector.samples(info.ppid):
                # a child of a target (followed since its fork, perhaps not yet drained): it counts for no limit
                self.collector.add_target(info.pid)
                continue
            mine = sum(1 for uid in self._added.values() if uid == info.uid)
            if len(self._added) >= limits.max_targets or mine >= limits.max_targets_per_user:
                self.too_many_targets += 1
                self.discovery.forget(info.pid)  # judged again at a later scan: there may be room then
                if self.too_many_targets in (1, 10, 100) or self.too_many_targets % 1000 == 0:
                    log.warning("target limit reached pid=%d comm=%s uid=%d limit=%d per_user=%d refused=%d",
                                info.pid, info.comm, info.uid, limits.max_targets, limits.max_targets_per_user,
                                self.too_many_targets)
                continue
            if not self.collector.add_target(info.pid):
                self.discovery.forget(info.pid)  # tried again at the next scan: there may be room by then
                continue
            self._added[info.pid] = info.uid
            log.info("watching pid=%d comm=%s runtimes=%s", info.pid, info.comm, ",".join(sorted(info.runtimes)))

    def _handle_exits(self, exited: list[int]) -> None:
        """Exits a collector saw (`exited` is emptied): discovery forgets them before its next scan."""
        for pid in exited:
            if pid in self.discovery.targets:
                log.info("target exited pid=%d", pid)
            self.discovery.forget(pid)
            self._added.pop(pid, None)
        exited.clear()

    def _capture_source(self, c: Capture) -> Collector:
        sampler = SamplerConfig(frequency=c.frequency, event="cpu-clock")
        return Collector(sampler, runtimes=True, label=f"trigger {c.name}",
                         max_probed_libraries=self.cfg.limits.max_probed_libraries)

    @staticmethod
    def _may_capture(pid: int) -> bool:
        return pid != os.getpid() and process_info(pid) is not None

    # --- reload ---------------------------------------------------------------------------------------------

    def _reload(self) -> None:
        assert self.windows is not None and self.captures is not None
        try:
            new = load_config(self.config_path) if self.config_path or self.cfg.source != "defaults" else self.cfg
        except Exception as e:  # a bad configuration, and anything else: the daemon keeps running as it was
            log.error("reload failed, keeping the old configuration: %s", e)
            return
        old = self.cfg
        if new.control != old.control:
            log.warning("reload: the control socket changes only at restart")
            new = DaemonConfig(new.watch, new.continuous, new.output, new.retention, new.trigger, new.limits,
                               old.control, new.source)
        self.cfg = new
        self.discovery.set_selector(Selector(new.watch))
        if new.output.dir != old.output.dir:
            self.out = OutputDirs(new.output.dir)
            self._prepare_output()
        self.windows.reconfigure(new, self.out)
        self.captures.reconfigure(new, self.out)
        resample = ((new.continuous.frequency, new.continuous.runtimes, new.continuous.launch_stacks)
                    != (old.continuous.frequency, old.continuous.runtimes, old.continuous.launch_stacks))
        if resample or new.output.dir != old.output.dir:
            self.windows.close("reload")
            if resample:
                assert self.collector is not None
                self.collector.close()
                self.collector = self._new_collector()
            assert self.collector is not None
            self.windows.open(self.collector)
        log.info("reloaded config=%s frequency=%d window_s=%g", new.source, new.continuous.frequency,
                 new.continuous.window_s)

    # --- control requests (control threads) and status (main loop) ------------------------------------------

    def _handle(self, req: Request) -> Response:
        if isinstance(req, StatusRequest):
            return Response(True, data=self.status.fresh())
        if isinstance(req, LatestRequest):
            return Response(True, data={"windows": [str(p) for p in self.out.latest_windows(req.count)]})
        assert self.captures is not None
        return self.captures.request(req)

    def _status(self) -> dict[str, Any]:
        c, windows, captures = self.collector, self.windows, self.captures
        assert c is not None and windows is not None and captures is not None
        elapsed = time.monotonic() - self._started
        cpu = own_cpu_s() - self._cpu_start
        targets = []
        # those discovery chose first: a target that forked thousands of children must not push them out of view
        for pid in sorted(c.targets, key=lambda p: p not in self._added)[:MAX_STATUS_TARGETS]:
            info = self.discovery.targets.get(pid)
            targets.append({"pid": pid, "comm": info.comm if info else "", "runtimes":
                            sorted(info.runtimes) if info else [], "via": "selector" if info else "child"})
        cont = self.cfg.continuous
        return {
            "pid": os.getpid(), "config": self.cfg.source, "uptime_s": round(elapsed, 1),
            "output": str(self.out.root), "frequency_hz": cont.frequency, "window_s": cont.window_s,
            "runtimes": cont.runtimes, "targets": targets, "target_count": len(c.targets),
            "windows_written": windows.written, "samples_total": windows.samples + c.window_samples,
            "counters": dict(windows.lost), "captures_written": captures.written,
            "capture_running": captures.running, "probed_libraries": c.probed_libraries,
            "exports_pending": self.exports.pending if self.exports else 0,
            "exports_skipped": self.exports.skipped if self.exports else 0,
            "agent_cpu_s": round(cpu, 3), "agent_cpu_pct": round(100 * cpu / elapsed, 3) if elapsed else 0.0,
            "rss_mb": round(own_rss_bytes() / (1 << 20), 1), "targets_over_limit": self.too_many_targets,
            "targets_refused": c.targets_refused, "controlling_tty": controlling_tty(),
        }


def run_daemon(config_path: Path | None) -> int:
    """`aiflame agent`: load the configuration and run until SIGTERM."""
    setup_logging()
    cfg = load_config(config_path)
    return Daemon(cfg, config_path).run()

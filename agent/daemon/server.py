"""The daemon: one main thread runs the continuous collector (rolling windows), process discovery and any
on-demand capture; a control thread answers the root-only Unix socket; an export thread finishes windows.

Signals: SIGTERM/SIGINT stop cleanly (the window in progress is closed complete and exported, a capture in
progress is finished and its client answered); SIGHUP re-reads the configuration (a bad file is logged and
the old configuration kept; the window in progress continues unless the sampling rate or probes changed, in
which case it is closed complete first).
"""

from __future__ import annotations

import logging
import os
import queue
import shutil
import signal
import socket
import stat
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

from aiflame.agent.daemon.collector import Collector
from aiflame.agent.daemon.config import DaemonConfig, load_config
from aiflame.agent.daemon.discovery import Discovery, Selector, process_info
from aiflame.agent.daemon.exports import ExportJob, ExportWorker
from aiflame.agent.daemon.protocol import (
    LatestRequest,
    ProtocolError,
    Request,
    Response,
    StatusRequest,
    TriggerRequest,
    encode_response,
    parse_request,
    peer_uid,
    read_line,
)
from aiflame.agent.daemon.windows import (
    CAPTURE_RE,
    FILE_UMASK,
    WINDOW_RE,
    OutputDirs,
    enforce_count,
    enforce_retention,
    list_stored,
    stamp,
)
from aiflame.agent.kernel.sampler import SamplerConfig
from aiflame.agent.preflight import SessionError, check_root
from aiflame.agent.procs import alive as _alive
from aiflame.agent.procs import own_cpu_s as _cpu_s
from aiflame.core.errors import HostError

log = logging.getLogger("aiflame.daemon")

# The main loop sleeps up to this long between drains (less when a fast rate on many CPUs could fill the ring
# sooner). Records that need the agent now (library opens), signals and control requests wake it at once.
POLL_S = 2.0
CAPTURE_POLL_S = 0.1  # while an on-demand capture runs: its targets may be stopped at a library open
STATUS_WAIT_S = 2.0  # a status request waits this long for the main loop to answer, then gets the last one
MAX_CLIENTS = 8  # control connections served at once
READ_TIMEOUT_S = 5.0


class DaemonError(HostError):
    """The daemon cannot start; one line."""


def setup_logging(level: int = logging.INFO) -> None:
    """One line per event on stderr (journald keeps it): `LEVEL event key=value ...`."""
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s aiflame-agent %(levelname)s %(message)s"))
    root = logging.getLogger("aiflame.daemon")
    root.handlers[:] = [handler]
    root.setLevel(level)
    root.propagate = False


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


@dataclass
class _Trigger:
    """An on-demand capture: requested by a client, run by the main loop, answered when finished."""

    seq: int
    req: TriggerRequest
    pids: list[int]
    duration_s: float
    frequency: int
    reply: Response | None = None
    done: threading.Event = field(default_factory=threading.Event)
    collector: Collector | None = None
    compile_error: str = ""
    compiled: threading.Event = field(default_factory=threading.Event)
    partial: Path | None = None
    deadline: float = 0.0


class Daemon:
    def __init__(self, cfg: DaemonConfig, config_path: Path | None = None) -> None:
        self.cfg = cfg
        self.config_path = config_path
        self.out = OutputDirs(cfg.output.dir)
        self._stop = ""
        self._reload = False
        self._requests: queue.Queue[_Trigger] = queue.Queue()
        self._trigger: _Trigger | None = None
        self._trigger_seq = 0
        self._window_seq = 0
        self._status: dict[str, Any] = {}
        self._status_lock = threading.Lock()
        self._status_waiters: list[threading.Event] = []
        self._wake_r = self._wake_w = -1  # the main loop's wakeup pipe (signals, control requests)
        self._poll_s = POLL_S
        self._clients = threading.BoundedSemaphore(MAX_CLIENTS)
        self._listener: socket.socket | None = None
        self._collector: Collector | None = None
        self._discovery = Discovery(Selector(cfg.watch), exclude_pids=[os.getpid()])
        self._exports: ExportWorker | None = None
        self._window_partial: Path | None = None
        self._window_end = 0.0
        self._started = time.monotonic()
        self._cpu_start = _cpu_s()
        self.windows_written = 0
        self.samples_total = 0
        self.lost_total: dict[str, int] = {}
        self.captures_written = 0
        self.too_many_targets = 0

    # --- signals --------------------------------------------------------------------------------------------

    def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
        if signum == signal.SIGHUP:
            self._reload = True
        else:
            self._stop = signal.Signals(signum).name

    # --- main -----------------------------------------------------------------------------------------------

    def run(self) -> int:
        try:
            check_root()
        except SessionError as e:
            raise DaemonError(str(e)) from None
        os.umask(FILE_UMASK)
        try:
            os.nice(self.cfg.limits.nice - os.nice(0))
        except OSError:
            pass
        for note in self._prepare_output():
            log.warning("%s", note)
        self._listen()
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        old_wakeup = signal.set_wakeup_fd(self._wake_w, warn_on_full_buffer=False)
        old = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
        self._exports = ExportWorker(self.cfg.limits.max_queued_exports)
        control = threading.Thread(target=self._serve, name="aiflame-control", daemon=True)
        try:
            self._collector = self._new_collector()
            control.start()
            log.info("started pid=%d config=%s output=%s socket=%s frequency=%d window_s=%g", os.getpid(),
                     self.cfg.source, self.cfg.output.dir, self.cfg.control.socket, self.cfg.continuous.frequency,
                     self.cfg.continuous.window_s)
            self._open_window()
            self._loop()
            self._finish()
        finally:
            self._close_listener()
            if self._trigger and self._trigger.collector:
                self._trigger.collector.close()
            if self._collector:
                self._collector.close()
            for s, h in old.items():
                signal.signal(s, h)
            signal.set_wakeup_fd(old_wakeup)
            os.close(self._wake_r)
            os.close(self._wake_w)
        log.info("stopped reason=%s windows=%d captures=%d", self._stop, self.windows_written,
                 self.captures_written)
        return 0

    def _prepare_output(self) -> list[str]:
        try:
            return self.out.prepare()
        except OSError as e:
            raise DaemonError(f"cannot use output directory {self.out.root}: {e}") from None

    def _new_collector(self) -> Collector:
        c = self.cfg.continuous
        sampler = SamplerConfig(frequency=c.frequency, event="cpu-clock", max_targets=self.cfg.limits.max_targets * 8)
        collector = Collector(sampler, c.runtimes, "continuous", self.cfg.limits.max_probed_libraries)
        t0 = time.monotonic()
        collector.start()
        log.info("sampler loaded frequency=%d runtimes=%s seconds=%.1f", c.frequency, c.runtimes,
                 time.monotonic() - t0)
        for pid in list(self._discovery.targets):
            collector.add_target(pid)
        collector.sampler.watch(self._wake_r)
        self._poll_s = collector.drain_interval(POLL_S)
        return collector

    def _loop(self) -> None:
        self._publish_status()
        next_scan = 0.0
        while not self._stop:
            now = time.monotonic()
            if now >= next_scan:
                self._scan()
                next_scan = now + self.cfg.watch.scan_interval_s
            assert self._collector is not None
            poll = CAPTURE_POLL_S if self._trigger is not None else self._poll_s
            wake_at = min(time.monotonic() + poll, next_scan, self._window_end)
            self._collector.tick(max(wake_at - time.monotonic(), 0))
            self._clear_wakeups()
            self._handle_exits(self._collector)
            self._run_trigger()
            if self._reload:
                self._reload = False
                self._do_reload()
            if time.monotonic() >= self._window_end:
                self._rotate("window end")
            self._answer_status()

    def _wake(self) -> None:
        """End the main loop's wait now (from the control thread)."""
        try:
            os.write(self._wake_w, b"\0")
        except OSError:  # full (a wakeup is pending anyway) or closed (stopping)
            pass

    def _clear_wakeups(self) -> None:
        try:
            while os.read(self._wake_r, 512):
                pass
        except OSError:  # empty
            pass

    def _finish(self) -> None:
        """Stop: close the window in progress complete, finish a capture in progress, wait for the exports."""
        if self._trigger is not None:
            self._end_trigger(f"daemon stopping ({self._stop})")
        self._close_window(f"daemon stopping ({self._stop})")
        self._fail_queued("the daemon is stopping")
        assert self._exports is not None
        if not self._exports.stop(timeout_s=60):
            log.warning("exports unfinished at exit; the next start keeps them as incomplete")

    # --- discovery ------------------------------------------------------------------------------------------

    def _scan(self) -> None:
        assert self._collector is not None
        new, gone = self._discovery.scan()
        for pid in gone:  # its exit event is still in the ring buffer, or was lost
            log.info("target exited pid=%d", pid)
            self._collector.remove_target(pid)
        for info in new:
            if len(self._collector.targets) >= self.cfg.limits.max_targets:
                self.too_many_targets += 1
                self._discovery.forget(info.pid)
                log.warning("target limit reached pid=%d comm=%s limit=%d", info.pid, info.comm,
                            self.cfg.limits.max_targets)
                continue
            log.info("watching pid=%d comm=%s runtimes=%s", info.pid, info.comm, ",".join(sorted(info.runtimes)))
            self._collector.add_target(info.pid)

    def _handle_exits(self, collector: Collector) -> None:
        for pid in collector.exited:
            if pid in self._discovery.targets:
                log.info("target exited pid=%d", pid)
            self._discovery.forget(pid)
        collector.exited.clear()

    # --- windows --------------------------------------------------------------------------------------------

    def _open_window(self) -> None:
        assert self._collector is not None
        wall = time.time()
        while True:
            name = f"{stamp(wall)}-{self._window_seq:06d}"
            self._window_seq += 1
            if not (self.out.windows / name).exists():
                break
        self._window_partial = self.out.new_partial(self.out.windows, name)
        self._collector.open_window(self._window_partial / "profile.aiflame")
        self._window_end = time.monotonic() + self.cfg.continuous.window_s

    def _close_window(self, reason: str) -> None:
        assert self._collector is not None and self._exports is not None
        if self._window_partial is None:
            return
        result = self._collector.close_window(reason)
        for w in result.warnings:
            log.warning("collector: %s", w)
        if not result.samples and not result.events and not result.pids:
            shutil.rmtree(self._window_partial, ignore_errors=True)  # nothing watched: no empty windows pile up
            self._window_partial = None
            return
        self.windows_written += 1
        self.samples_total += result.samples
        for k, v in result.counters.items():
            self.lost_total[k] = self.lost_total.get(k, 0) + v
        log.info("window closed dir=%s samples=%d events=%d lost=%d targets=%d reason=%s",
                 self._window_partial.name[len(".partial-"):], result.samples, result.events,
                 result.counters.get("lost", 0), len(result.pids), reason.replace(" ", "-"))
        cfg = self.cfg
        self._exports.submit(ExportJob(self._window_partial, cfg.output.formats, "aiflame window",
                                       done=self._window_published), block=reason != "window end")
        self._window_partial = None

    def _window_published(self, final: Path, _files: list[Path], notes: list[str]) -> None:
        r = self.cfg.retention
        deleted = enforce_retention(self.out.windows, WINDOW_RE, time.time(), r.max_age_h * 3600,
                                    int(r.max_total_mb * (1 << 20)))
        for d in deleted:
            log.info("retention deleted dir=%s", d.name)
        for n in notes:
            log.warning("window %s: %s", final.name, n)

    def _rotate(self, reason: str) -> None:
        self._close_window(reason)
        self._open_window()

    # --- reload ---------------------------------------------------------------------------------------------

    def _do_reload(self) -> None:
        try:
            new = load_config(self.config_path) if self.config_path or self.cfg.source != "defaults" else self.cfg
        except Exception as e:  # ConfigError, and anything else: the daemon keeps running as it was
            log.error("reload failed, keeping the old configuration: %s", e)
            return
        old = self.cfg
        if new.control != old.control:
            log.warning("reload: the control socket changes only at restart")
            new = DaemonConfig(new.watch, new.continuous, new.output, new.retention, new.trigger, new.limits,
                               old.control, new.source)
        self.cfg = new
        self._discovery.set_selector(Selector(new.watch))
        if new.output.dir != old.output.dir:
            self.out = OutputDirs(new.output.dir)
            for note in self._prepare_output():
                log.warning("%s", note)
        resample = (new.continuous.frequency, new.continuous.runtimes) != (old.continuous.frequency,
                                                                          old.continuous.runtimes)
        if resample or new.output.dir != old.output.dir:
            self._close_window("reload")
            if resample:
                assert self._collector is not None
                self._collector.close()
                self._collector = self._new_collector()
            self._open_window()
        else:
            self._window_end += new.continuous.window_s - old.continuous.window_s
        log.info("reloaded config=%s frequency=%d window_s=%g", new.source, new.continuous.frequency,
                 new.continuous.window_s)

    # --- on-demand captures ---------------------------------------------------------------------------------

    def _run_trigger(self) -> None:
        t = self._trigger
        if t is None:
            try:
                t = self._requests.get_nowait()
            except queue.Empty:
                return
            self._start_trigger(t)
            return
        if not t.compiled.is_set():
            return
        if t.collector is None or t.compile_error:
            self._answer(t, Response(False, f"cannot start the capture: {t.compile_error}"))
            return
        if t.partial is None:
            self._trigger_begin(t)
            return
        t.collector.tick(0)
        self._handle_exits(t.collector)
        if time.monotonic() >= t.deadline or not any(_alive(p) for p in t.collector.targets):
            self._end_trigger("duration" if time.monotonic() >= t.deadline else "targets exited")

    def _start_trigger(self, t: _Trigger) -> None:
        """Compile the high-resolution sampler on a helper thread (BCC releases the GIL while it compiles)."""
        self._trigger = t
        sampler = SamplerConfig(frequency=t.frequency, event="cpu-clock")
        collector = Collector(sampler, runtimes=True, label=f"trigger c{t.seq:04d}",
                              max_probed_libraries=self.cfg.limits.max_probed_libraries)

        def compile_it() -> None:
            try:
                collector.start()
                t.collector = collector
            except Exception as e:
                t.compile_error = str(e)
                collector.close()
            t.compiled.set()

        threading.Thread(target=compile_it, name="aiflame-compile", daemon=True).start()
        log.info("capture requested id=c%04d pids=%s duration_s=%g frequency=%d", t.seq,
                 ",".join(map(str, t.pids)), t.duration_s, t.frequency)

    def _trigger_begin(self, t: _Trigger) -> None:
        assert t.collector is not None
        name = f"{stamp(time.time())}-c{t.seq:04d}"
        t.partial = self.out.new_partial(self.out.captures, name)
        t.collector.open_window(t.partial / "profile.aiflame", target="pids " + ",".join(map(str, t.pids)))
        for pid in t.pids:
            t.collector.add_target(pid)
        t.deadline = time.monotonic() + t.duration_s
        log.info("capture started id=c%04d targets=%d", t.seq, len(t.collector.targets))

    def _end_trigger(self, reason: str) -> None:
        t = self._trigger
        assert t is not None and self._exports is not None
        if t.collector is None or t.partial is None:
            if t.collector:
                t.collector.close()
            self._answer(t, Response(False, f"capture cancelled: {reason}"))
            return
        result = t.collector.close_window(reason)
        t.collector.close()
        for w in result.warnings:
            log.warning("capture c%04d: %s", t.seq, w)
        self.captures_written += 1
        log.info("capture closed id=c%04d samples=%d events=%d reason=%s", t.seq, result.samples, result.events,
                 reason.replace(" ", "-"))
        formats = tuple(dict.fromkeys([*self.cfg.output.formats, "folded", "svg", *(["chakra"] if t.req.chakra
                                                                                   else [])]))

        def done(final: Path, files: list[Path], notes: list[str]) -> None:
            enforce_count(self.out.captures, CAPTURE_RE, self.cfg.retention.keep_captures)
            self._answer(t, Response(True, data={
                "dir": str(final), "capture": str(final / "profile.aiflame"), "files": [str(f) for f in files],
                "samples": result.samples, "events": result.events, "lost": result.counters.get("lost", 0),
                "pids": t.pids, "stop_reason": reason, "notes": notes,
            }))

        self._exports.submit(ExportJob(t.partial, formats, f"aiflame capture c{t.seq:04d}", done=done), block=True)
        self._trigger = None

    def _answer(self, t: _Trigger, resp: Response) -> None:
        t.reply = resp
        t.done.set()
        if self._trigger is t:
            self._trigger = None

    def _fail_queued(self, why: str) -> None:
        while True:
            try:
                t = self._requests.get_nowait()
            except queue.Empty:
                return
            self._answer(t, Response(False, why))

    # --- control socket -------------------------------------------------------------------------------------

    def _listen(self) -> None:
        path = self.cfg.control.socket
        try:
            path.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
            try:
                st = os.lstat(path)
                if not stat.S_ISSOCK(st.st_mode):
                    raise DaemonError(f"{path} exists and is not a socket; not touching it")
                probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                try:
                    probe.connect(str(path))
                    raise DaemonError(f"another daemon is listening on {path}")
                except (ConnectionRefusedError, FileNotFoundError):
                    os.unlink(path)  # stale: left by a daemon that died
                finally:
                    probe.close()
            except FileNotFoundError:
                pass
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            old_umask = os.umask(0o177)  # the socket is born 0600: no window where others may connect
            try:
                sock.bind(str(path))
            finally:
                os.umask(old_umask)
            os.chmod(path, 0o600)
            sock.listen(16)
        except OSError as e:
            raise DaemonError(f"cannot listen on {path}: {e.strerror}") from None
        self._listener = sock

    def _close_listener(self) -> None:
        if self._listener is not None:
            try:
                self._listener.shutdown(socket.SHUT_RDWR)  # wakes the control thread out of accept()
            except OSError:
                pass
            self._listener.close()
            self._listener = None
            try:
                os.unlink(self.cfg.control.socket)
            except OSError:
                pass

    def _serve(self) -> None:
        while not self._stop and self._listener is not None:
            try:
                conn, _ = self._listener.accept()
            except OSError:  # shut down: the daemon is stopping
                return
            if not self._clients.acquire(blocking=False):
                self._reply(conn, Response(False, "busy: too many control connections"))
                continue
            threading.Thread(target=self._client, args=(conn,), name="aiflame-client", daemon=True).start()

    @staticmethod
    def _reply(conn: socket.socket, resp: Response) -> None:
        try:
            conn.sendall(encode_response(resp))
        except OSError:
            pass
        finally:
            conn.close()

    def _client(self, conn: socket.socket) -> None:
        try:
            uid = peer_uid(conn)
            if uid != 0:
                log.warning("refused control connection uid=%d", uid)
                self._reply(conn, Response(False, "refused: only root may use the aiflame control socket"))
                return
            conn.settimeout(READ_TIMEOUT_S)
            try:
                req = parse_request(read_line(conn))
            except ProtocolError as e:
                log.warning("bad control request: %s", e)
                self._reply(conn, Response(False, f"bad request: {e}"))
                return
            self._reply(conn, self._handle(req))
        except Exception as e:  # a client must never take the daemon down
            log.error("control connection failed: %s", e)
            self._reply(conn, Response(False, "internal error"))
        finally:
            self._clients.release()

    def _handle(self, req: Request) -> Response:
        if isinstance(req, StatusRequest):
            return Response(True, data=self._fresh_status())
        if isinstance(req, LatestRequest):
            stored = list_stored(self.out.windows, WINDOW_RE)[-req.count:]
            return Response(True, data={"windows": [str(s.path) for s in stored]})
        return self._trigger_request(req)

    def _trigger_request(self, req: TriggerRequest) -> Response:
        tc = self.cfg.trigger
        duration = tc.default_duration_s if req.duration_s is None else req.duration_s
        freq = tc.default_frequency if req.frequency is None else req.frequency
        if duration > tc.max_duration_s:
            return Response(False, f"duration {duration:g} s exceeds the configured maximum ({tc.max_duration_s:g} s)")
        if freq > tc.max_frequency:
            return Response(False, f"frequency {freq} Hz exceeds the configured maximum ({tc.max_frequency} Hz)")
        if req.all_targets:
            pids = sorted(self._discovery.targets)
            if not pids:
                return Response(False, "no watched processes to capture")
        else:
            pids = list(req.pids)
            for pid in pids:
                if pid == os.getpid() or process_info(pid) is None:
                    return Response(False, f"no such process: {pid}")
        if self._trigger is not None or not self._requests.empty():
            return Response(False, "busy: another capture is running; try again when it is done")
        self._trigger_seq += 1
        t = _Trigger(self._trigger_seq, req, pids, duration, freq)
        self._requests.put(t)
        self._wake()
        if not t.done.wait(duration + 120):
            return Response(False, "the capture did not finish in time")
        assert t.reply is not None
        return t.reply

    # --- status ---------------------------------------------------------------------------------------------
    # Built by the main loop (it owns the collector) when a client asks, not on a timer: an idle daemon spends
    # nothing on it.

    def _fresh_status(self) -> dict[str, Any]:
        """(Control thread) ask the main loop for a status and wait for it; the last one if it is busy."""
        ready = threading.Event()
        with self._status_lock:
            self._status_waiters.append(ready)
        self._wake()
        ready.wait(STATUS_WAIT_S)
        with self._status_lock:
            if ready in self._status_waiters:
                self._status_waiters.remove(ready)
            return dict(self._status)

    def _answer_status(self) -> None:
        with self._status_lock:
            waiting, self._status_waiters = self._status_waiters, []
        if waiting:
            self._publish_status()
            for ready in waiting:
                ready.set()

    def _publish_status(self) -> None:
        c = self._collector
        assert c is not None
        elapsed = time.monotonic() - self._started
        cpu = _cpu_s() - self._cpu_start
        targets = []
        for pid in c.targets[:200]:
            info = self._discovery.targets.get(pid)
            targets.append({"pid": pid, "comm": info.comm if info else "", "runtimes":
                            sorted(info.runtimes) if info else [], "via": "selector" if info else "child"})
        cont = self.cfg.continuous
        status = {
            "pid": os.getpid(), "config": self.cfg.source, "uptime_s": round(elapsed, 1),
            "output": str(self.out.root), "frequency_hz": cont.frequency, "window_s": cont.window_s,
            "runtimes": cont.runtimes, "targets": targets, "target_count": len(c.targets),
            "windows_written": self.windows_written, "samples_total": self.samples_total + c.window_samples,
            "counters": dict(self.lost_total), "captures_written": self.captures_written,
            "capture_running": self._trigger is not None, "probed_libraries": c.probed_libraries,
            "exports_pending": self._exports.pending if self._exports else 0,
            "exports_skipped": self._exports.skipped if self._exports else 0,
            "agent_cpu_s": round(cpu, 3), "agent_cpu_pct": round(100 * cpu / elapsed, 3) if elapsed else 0.0,
            "rss_mb": round(_rss_bytes() / (1 << 20), 1), "targets_over_limit": self.too_many_targets,
        }
        with self._status_lock:
            self._status = status


def run_daemon(config_path: Path | None) -> int:
    """`aiflame agent`: load the configuration and run until SIGTERM."""
    setup_logging()
    cfg = load_config(config_path)
    return Daemon(cfg, config_path).run()

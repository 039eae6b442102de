"""The Python runtime plug-in as the capture session uses it: detect CPython in a process, configure the BPF
walker for it, and read the code objects its samples name while the process is alive."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from aiflame.agent.kernel.records import PyProcRec
from aiflame.agent.python.detect import PyTarget, PythonNotLoaded, detect_python
from aiflame.core.errors import HostError
from aiflame.core.python_layouts import PyLayout
from aiflame.core.raw import PyCode, PyRuntimeInfo
from aiflame.symbolize.python.code import CodeResolver

log = logging.getLogger(__name__)


# The offset fields of struct py_proc, each named as in PyLayout.
_OFFSET_FIELDS = tuple(f[0] for f in PyProcRec._fields_ if f[0] not in ("runtime", "version", "tid_offset",
                                                                         "frame_read", "pad"))


def proc_rec(t: PyTarget) -> PyProcRec:
    """The walker's per-process configuration (struct py_proc) for a detected interpreter."""
    lay: PyLayout = t.layout
    rec = PyProcRec(runtime=t.runtime_addr, version=(t.version[0] << 8) | t.version[1], tid_offset=t.tid_offset,
                    frame_read=frame_read_size(lay))
    for name in _OFFSET_FIELDS:
        setattr(rec, name, getattr(lay, name))
    return rec


def frame_read_size(lay: PyLayout) -> int:
    """Bytes that cover every frame field the walker reads (8-byte reads; owner/is_entry read 8 bytes too)."""
    offs = [lay.frame_code, lay.frame_back, lay.frame_instr, lay.frame_owner, lay.frame_is_entry]
    size = max(o for o in offs if o >= 0) + 8
    if size > 128:
        raise ValueError(f"Python {lay.version}: frame fields beyond 128 bytes")
    return size


@dataclass
class PythonProcess:
    target: PyTarget
    resolver: CodeResolver
    written: dict[int, tuple[str, str, int]] = field(default_factory=dict)  # code addr -> what we recorded


class PythonPlugin:
    """Tracks the Python processes of one capture."""

    def __init__(self) -> None:
        self.procs: dict[int, PythonProcess] = {}
        self.warnings: list[str] = []
        self._tries: dict[tuple[int, int], tuple[int, float]] = {}  # (pid, exec_seq) -> (attempts, last time)
        self._absent: set[tuple[int, int]] = set()

    RETRIES = 8  # a just-started interpreter fails the live checks until it has initialised
    RETRY_S = 0.25

    def forget(self, pid: int) -> None:
        """The process exec'd or exited: its interpreter (if any) is gone."""
        old = self.procs.pop(pid, None)
        if old:
            old.resolver.close()

    def attach(self, pid: int, exec_seq: int, force: bool = False) -> tuple[PyTarget, PyRuntimeInfo] | None:
        """Detect CPython in `pid`; None when there is none (yet) or it cannot be walked. Rate-limited, except
        with `force` (the target is being stopped at a library open: a good moment, and it will not come back;
        retried after shorter pauses)."""
        if pid in self.procs or (pid, exec_seq) in self._absent:
            return None
        n, last = self._tries.get((pid, exec_seq), (0, 0.0))
        now = time.monotonic()
        if not force and (n >= self.RETRIES or now - last < self.RETRY_S):
            return None
        # A forced try does not use up the timed ones: a starting interpreter stops at every library open
        # (and at each path the loader tries), and those tries all come before it has initialised.
        tries = n if force else n + 1
        self._tries[(pid, exec_seq)] = (tries, now)
        try:
            t = detect_python(pid, stopped=force)
        except PythonNotLoaded:
            return None  # read between its exec and the loader: not absent, ask again
        except HostError as e:
            if not force and tries == self.RETRIES:
                self.warnings.append(f"{e}; its native frames are still profiled")
            return None
        except OSError:
            return None
        if t is None:
            self._absent.add((pid, exec_seq))  # no CPython in this image
            return None
        self.procs[pid] = PythonProcess(t, CodeResolver(pid, t.layout))
        v = ".".join(map(str, t.version))
        return t, PyRuntimeInfo(pid, v, t.layout.source, t.binary)

    def codes(self, named: Iterable[tuple[int, int]], time_ns: int) -> list[PyCode]:
        """Code objects named by the (pid, code address) pairs `named` (agent/pipeline.py: of samples or events) that
        were not yet recorded (or changed at the same address). Each is re-validated once per call."""
        out: list[PyCode] = []
        for pid, addr in dict.fromkeys(named):
            proc = self.procs.get(pid)
            if proc is None:
                continue
            info = proc.resolver.resolve(addr)
            if info is None:
                continue
            key = (info.qualname, info.filename, info.firstlineno)
            if proc.written.get(addr) == key:
                continue
            proc.written[addr] = key
            out.append(PyCode(pid, addr, time_ns, info))
        return out

    def close(self) -> None:
        for p in self.procs.values():
            p.resolver.close()
        self.procs.clear()

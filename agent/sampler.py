"""The CPU sampler: compiles bpf/cpu_sampler.bpf.c once, attaches it to perf events on every CPU, and drains
its ring buffer on the caller's timer (records are submitted without wakeups)."""

from __future__ import annotations

import ctypes
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiflame.agent.records import Counter, ProcRec, PyProcRec, RecKind, SampleRec
from aiflame.raw import RawPyFrame, RawSample

BPF_DIR = Path(__file__).resolve().parent.parent / "bpf"
SOURCE = BPF_DIR / "cpu_sampler.bpf.c"


class SamplerError(Exception):
    """BPF could not be loaded or attached; one user-facing line."""


@dataclass(frozen=True)
class SamplerConfig:
    frequency: int = 99
    event: str = "auto"  # auto (cycles where the PMU allows, else cpu-clock), cpu-clock, cycles
    follow_children: bool = False
    all_processes: bool = False
    ringbuf_pages: int = 2048  # 8 MiB: ~4000 samples of slack between drains
    max_targets: int = 16384

    def cflags(self) -> list[str]:
        flags = [
            f"-I{BPF_DIR}",
            f"-DAIFLAME_RINGBUF_PAGES={self.ringbuf_pages}",
            f"-DAIFLAME_MAX_TARGETS={self.max_targets}",
        ]
        if self.follow_children:
            flags.append("-DAIFLAME_FOLLOW")
        if self.all_processes:
            flags.append("-DAIFLAME_ALL")
        return flags


@dataclass(frozen=True, slots=True)
class ProcEvent:
    kind: RecKind
    time_ns: int
    pid: int
    child: int
    comm: str


def bpf_source(config: SamplerConfig) -> str:
    """The program text as BCC compiles it, with the defines spelled out (for --print-bpf)."""
    defines = "".join(
        "#define " + f[2:].replace("=", " ", 1) + "\n" for f in config.cflags() if f.startswith("-D")
    )
    header = (BPF_DIR / "aiflame.h").read_text()
    return defines + SOURCE.read_text().replace('#include "aiflame.h"', header)


_HEAD = struct.Struct("<IIQIIii16sII")  # sample_rec up to data[]
_P_HEAD = struct.Struct("<IIQII16s")
assert _HEAD.size == SampleRec.data.offset and _P_HEAD.size == ctypes.sizeof(ProcRec)


def decode_record(buf: bytes) -> RawSample | ProcEvent | None:
    """Turn one ring-buffer record into a RawSample or ProcEvent (None for an unknown kind)."""
    kind = int.from_bytes(buf[:4], "little")
    if kind == RecKind.SAMPLE:
        _, cpu, t, pid, tid, ulen, klen, comm, py_count, py_flags = _HEAD.unpack_from(buf)
        words = (len(buf) - _HEAD.size) // 8
        data = struct.unpack_from(f"<{words}Q", buf, _HEAD.size) if words > 0 else ()
        nu = min(max(ulen, 0) // 8, len(data))
        nk = min(max(klen, 0) // 8, len(data) - nu)
        npy = min(py_count, (len(data) - nu - nk) // 2)
        base = nu + nk
        py = tuple(
            RawPyFrame(data[base + 2 * i], data[base + 2 * i + 1] & 0xFFFFFFFF, (data[base + 2 * i + 1] >> 32) & 0xFF,
                       (data[base + 2 * i + 1] >> 40) & 0xFF)
            for i in range(npy)
        )
        return RawSample(
            t, pid, tid, cpu, comm.split(b"\0", 1)[0].decode(errors="replace"), tuple(data[:nu]),
            tuple(data[nu:nu + nk]), min(ulen, 0), min(klen, 0), 1, py, py_flags,
        )
    if kind in (RecKind.FORK, RecKind.EXEC, RecKind.EXIT):
        _, _cpu, t, pid, child, comm = _P_HEAD.unpack_from(buf)
        return ProcEvent(RecKind(kind), t, pid, child, comm.split(b"\0", 1)[0].decode(errors="replace"))
    return None


class CpuSampler:
    """Owns the BPF object. Call start(), then poll() on a timer, then close()."""

    def __init__(
        self,
        config: SamplerConfig,
        on_sample: Callable[[RawSample], None],
        on_proc: Callable[[ProcEvent], None],
    ) -> None:
        self.config = config
        self._on_sample = on_sample
        self._on_proc = on_proc
        self._bpf: Any = None
        self.event_used = ""

    def start(self, pids: list[int]) -> None:
        try:
            from bcc import BPF, PerfHWConfig, PerfSWConfig, PerfType
        except ImportError:
            raise SamplerError("BCC is not importable: run `make setup` (Debian's python3-bpfcc)") from None
        try:
            self._bpf = BPF(text=SOURCE.read_text(), cflags=self.config.cflags())
        except Exception as e:  # BCC raises bare Exception for compile/load failures
            raise SamplerError(f"cannot load the BPF sampler: {e} (see `aiflame doctor`)") from None
        for pid in pids:
            self.add_target(pid)
        self._bpf["events"].open_ring_buffer(self._callback)
        choices = {"cpu-clock": [("cpu-clock", PerfType.SOFTWARE, PerfSWConfig.CPU_CLOCK)],
                   "cycles": [("cycles", PerfType.HARDWARE, PerfHWConfig.CPU_CYCLES)]}
        choices["auto"] = choices["cycles"] + choices["cpu-clock"]
        errors = []
        for name, ev_type, ev_config in choices[self.config.event]:
            try:
                self._bpf.attach_perf_event(ev_type=ev_type, ev_config=ev_config, fn_name="on_sample",
                                            sample_freq=self.config.frequency, cpu=-1)
                self.event_used = name
                break
            except Exception as e:
                errors.append(f"{name}: {e}")
        if not self.event_used:
            self.close()
            raise SamplerError("cannot open perf events: " + "; ".join(errors))

    def _callback(self, _ctx: Any, data: Any, size: int) -> None:
        rec = decode_record(ctypes.string_at(data, size))
        if isinstance(rec, RawSample):
            self._on_sample(rec)
        elif rec is not None:
            self._on_proc(rec)

    def add_target(self, pid: int) -> None:
        t = self._bpf["targets"]
        t[t.Key(pid)] = t.Leaf(1)

    def remove_target(self, pid: int) -> None:
        t = self._bpf["targets"]
        try:
            del t[t.Key(pid)]
        except KeyError:
            pass

    def set_python(self, pid: int, proc: PyProcRec) -> None:
        """Turn on the Python walk for `pid` with its layout (or update it)."""
        t = self._bpf["py_procs"]
        t[t.Key(pid)] = t.Leaf.from_buffer_copy(bytes(proc))

    def clear_python(self, pid: int) -> None:
        t = self._bpf["py_procs"]
        try:
            del t[t.Key(pid)]
        except KeyError:
            pass

    def targets(self) -> list[int]:
        return [k.value for k in self._bpf["targets"].keys()]

    def poll(self) -> None:
        """Drain everything in the ring buffer now (no waiting)."""
        self._bpf.ring_buffer_consume()

    def counters(self) -> dict[str, int]:
        table = self._bpf["counters"]
        out = {}
        for c in Counter:
            out[c.name.lower()] = int(sum(table[table.Key(c.value)]))
        return out

    def layouts(self) -> tuple[Any, Any, Any]:
        """BCC's ctypes views of struct sample_rec and struct proc_rec, read from the compiled C."""
        return self._bpf["layout_sample"].Leaf, self._bpf["layout_proc"].Leaf, self._bpf["layout_py_proc"].Leaf

    def close(self) -> None:
        if self._bpf is not None:
            self._bpf.cleanup()
            self._bpf = None


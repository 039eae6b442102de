"""The modules a CPU sample crosses, from its ring-buffer record to its line in the folded file, measured by
running the real functions on one record: the sampler's record callback, the pipeline's drain into a capture
file, then the road (read, symbolize, views, write). Used by tests/unit/test_sample_path.py; docs/paths.md has
what it measures. To print a path (as root for the second, which profiles CMD for real):

    .venv/bin/python -m tests.sample_path
    .venv/bin/python -m tests.sample_path -o DIR --no-runtimes -d 1 --formats folded -- CMD
    .venv/bin/python -m tests.sample_path --stalls RUN_CAPTURE CUPTI_STREAM   (GPU stall samples, see below)

A module holds the sample while one of its functions has it: gets it (or something that holds it: a list, the
capture, the profile, a view) as an argument, or gets it back from a call. The sample is the record's bytes, the
RawSample decoded from them, the capture file's protobuf record, the model's Sample. Methods of the value's own
types (core/raw.py, core/model.py, the generated protobuf module) are the value, not a module it crosses. Only
the ring buffer's consumer (agent/kernel/ringbuf.py: it cuts the record's bytes out of the BPF map's memory and
hands them to the callback) needs a live BPF map and is not run: the path starts at its callback."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import fields, is_dataclass
from pathlib import Path
from types import FrameType
from typing import Any

from aiflame.core import aiflame_capture_pb2 as pb
from aiflame.core import model, raw

REPO = Path(__file__).resolve().parent.parent
LAYERS = ("cli", "agent", "exporters", "symbolize", "core")  # top-level folders, highest first
# The value's own types: their methods are the value at work, not a module it crosses.
OWN = {"core/raw.py", "core/model.py", "core/aiflame_capture_pb2.py"}
_FORMS = (raw.RawSample, model.Sample, pb.Sample)
_DEPTH = 4  # a list of views -> a view -> its profile -> its samples -> the Sample
_SCAN = 64  # items of a container looked at
_SAMPLE_KIND = 1  # RecKind.SAMPLE (agent/kernel/records.py), checked by the test


def module_of(code_file: str) -> str | None:
    """`agent/kernel/decode.py` for a file of a layer (through the package's links or not); None otherwise."""
    try:
        rel = Path(os.path.realpath(code_file)).relative_to(REPO)
    except ValueError:
        return None
    return rel.as_posix() if rel.parts[0] in LAYERS else None


def layer_of(module: str) -> str:
    return module.split("/", 1)[0]


class Tracker:
    """A profile function (sys.setprofile) that notes, in order, the modules holding one sample: the record
    `record` (its bytes), then what is made of it (matched by time, pid and tid); without `record`, the first
    sample record the sampler's callback gets. `path` holds (module, how): "call" (a function of it got the
    sample) or "return" (it got the sample back from a call, or returned it)."""

    def __init__(self, record: bytes | None = None) -> None:
        self.record = b""
        self.key: tuple[int, int, int] | None = None
        self.path: list[tuple[str, str]] = []
        if record is not None:
            self.seed(record)

    def seed(self, record: bytes) -> None:
        from aiflame.agent.kernel.decode import decode_record

        s = decode_record(record)
        assert isinstance(s, raw.RawSample)
        self.record, self.key = record, (s.time_ns, s.pid, s.tid)

    def is_it(self, v: object) -> bool | None:
        """Whether `v` is the sample in one of its forms; None: `v` is none of them (look inside it)."""
        if isinstance(v, _FORMS):
            return (v.time_ns, v.pid, v.tid) == self.key
        if type(v) is bytes:
            return v == self.record
        return None

    def holds(self, v: object, depth: int = _DEPTH) -> bool:
        found = self.is_it(v)
        if found is not None:
            return found
        if depth == 0 or isinstance(v, (str, bytes, int, float, type)) or v is None:
            return False
        items: Any
        if isinstance(v, (list, tuple, set, frozenset)):
            items = v
        elif isinstance(v, dict):
            items = v.values()
        elif is_dataclass(v):
            items = [getattr(v, f.name, None) for f in fields(v)]
        elif type(v).__module__.startswith("aiflame.") and hasattr(v, "__dict__"):
            items = list(vars(v).values())
        else:
            return False
        return any(self.holds(x, depth - 1) for _, x in zip(range(_SCAN), items, strict=False))

    def note(self, module: str | None, how: str) -> None:
        if module is not None and module not in OWN and (not self.path or self.path[-1] != (module, how)):
            self.path.append((module, how))

    def __call__(self, frame: FrameType, event: str, arg: object) -> None:
        if event == "call":
            module = module_of(frame.f_code.co_filename)
            if module is None or module in OWN:
                return
            code = frame.f_code
            args = [frame.f_locals.get(n) for n in code.co_varnames[:code.co_argcount + code.co_kwonlyargcount]]
            if self.key is None and code.co_name == "_callback" and module == "agent/kernel/sampler.py":
                buf = args[1]
                if isinstance(buf, bytes) and int.from_bytes(buf[:4], "little") == _SAMPLE_KIND:
                    self.seed(buf)
            if self.record and any(self.holds(a) for a in args):
                self.note(module, "call")
        elif event == "return" and self.record and arg is not None and frame.f_back is not None:
            module = module_of(frame.f_code.co_filename)
            if module is not None and self.holds(arg):
                self.note(module, "return")
                self.note(module_of(frame.f_back.f_code.co_filename), "return")


def _sample_record(pid: int, user: list[int]) -> bytes:
    from aiflame.agent.kernel.records import RecKind, SampleRec

    rec = SampleRec(kind=RecKind.SAMPLE, cpu=0, time_ns=time.monotonic_ns(), pid=pid, tid=pid, user_len=8 * len(user),
                    comm=b"sleep")
    for i, addr in enumerate(user):
        rec.data[i] = addr
    return bytes(rec)[:SampleRec.data.offset + 8 * len(user)]  # the BPF side copies only the used part


def _code_addresses(pid: int) -> list[int]:
    """Two addresses in the first executable file mapping of `pid`: a leaf and its caller."""
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        parts = line.split()
        if len(parts) >= 6 and "x" in parts[1] and parts[5].startswith("/"):
            start = int(parts[0].split("-")[0], 16)
            return [start + 0x40, start + 0x81]
    raise RuntimeError(f"no executable file mapping in /proc/{pid}/maps")


@contextmanager
def _target() -> Iterator[int]:
    proc = subprocess.Popen(["sleep", "60"])
    try:
        time.sleep(0.05)  # exec'd: its maps are sleep's
        yield proc.pid
    finally:
        proc.kill()
        proc.wait()


def trace_cpu_sample() -> tuple[list[tuple[str, str]], str]:
    """The modules that hold one CPU sample in order, from its ring-buffer record to the folded file, and the file."""
    from aiflame.agent.kernel.sampler import CpuSampler, SamplerConfig
    from aiflame.agent.pipeline import CapturePipeline
    from aiflame.core.capture import FORMAT_VERSION, CaptureWriter
    from aiflame.core.raw import CaptureFooter, CaptureHeader
    from aiflame.exporters.write import write_views
    from aiflame.symbolize.road import open_capture

    with _target() as pid, tempfile.TemporaryDirectory() as tmp:
        record = _sample_record(pid, _code_addresses(pid))
        path = Path(tmp) / "profile.aiflame"
        pipeline = CapturePipeline(runtimes=False)
        # As CapturePipeline.start makes it, not started: no BPF object, so no ring buffer and no CFI tables.
        pipeline.sampler = CpuSampler(SamplerConfig(), pipeline._samples.append, pipeline._procs.append)
        writer = CaptureWriter(path, CaptureHeader(FORMAT_VERSION, target="sleep", frequency_hz=99))
        pipeline.open_file(writer)
        tracker = Tracker(record)
        sys.setprofile(tracker)
        try:
            pipeline.sampler._callback(record)  # what the ring buffer's consumer does with each record
            pipeline.drain()
            writer.close(CaptureFooter(samples=1))
            written = write_views(open_capture(path).views(), ["folded"], path.parent)
        finally:
            sys.setprofile(None)
        (folded,) = written.files
        return tracker.path, folded.read_text()


class StallTracker(Tracker):
    """The modules that hold the GPU stall samples of one CUPTI stream (`record`: its bytes), by their forms: the
    parsed stream and its per-instruction totals, RawStallSample, the capture's StallSample record, the stall
    view's profile and samples. A stream's samples travel together, so they are followed as one."""

    def seed(self, record: bytes) -> None:
        self.record = record

    def is_it(self, v: object) -> bool | None:
        from aiflame.symbolize.stalls import STALL_UNIT
        from aiflame.symbolize.vendor.cupti_stream import CuptiStream, PcTotal, StreamStalls

        if type(v) is bytes:
            return v == self.record
        if isinstance(v, raw.RawStream):
            return v.data == self.record
        if isinstance(v, (CuptiStream, PcTotal, StreamStalls, raw.RawStallSample, pb.StallSample, pb.Stream)):
            return True
        if isinstance(v, model.Profile):
            return v.unit == STALL_UNIT
        if isinstance(v, model.Sample):
            return any(f.kind == model.FrameKind.STALL for f in v.stack)
        return None


def trace_stall_samples(run: Path | raw.Capture, stream: Path | bytes) -> tuple[list[tuple[str, str]], str]:
    """The modules that hold the stall samples of the CUPTI stream `stream` (a file, or its bytes) as the live
    collector takes it in (agent/accel/cupti.py `CuptiCollector.collect`) into a capture holding what the capture
    `run` holds, and on to the stalls view's folded file; and that file. `run` and `stream`: as
    examples/ai_flamegraph/make.sh makes them without a GPU (run/profile.aiflame, cupti.stream), or smaller."""
    from aiflame.agent.accel.cupti import CuptiCollector, CuptiOptions, StreamDir
    from aiflame.core.capture import CaptureWriter, read_capture, write_records
    from aiflame.exporters.write import write_views
    from aiflame.symbolize.road import open_capture

    cap = run if isinstance(run, raw.Capture) else read_capture(run)
    data = stream if isinstance(stream, bytes) else stream.read_bytes()
    with tempfile.TemporaryDirectory() as tmp:
        streams = StreamDir(Path(tmp))
        (streams.path / "cupti-1.stream").write_bytes(data)
        writer = CaptureWriter(Path(tmp) / "profile.aiflame", cap.header)
        write_records(writer, cap)
        # CUPTI's install is read by child_env only, which a capture that already ran does not need.
        collector = CuptiCollector(None, Path(), streams, CuptiOptions())  # type: ignore[arg-type]
        tracker = StallTracker(data)
        sys.setprofile(tracker)
        try:
            collector.collect(writer, keep_streams=True)
            writer.close(cap.footer or raw.CaptureFooter())
            written = write_views(open_capture(Path(tmp) / "profile.aiflame").views(), ["folded"], Path(tmp))
        finally:
            sys.setprofile(None)
            streams.close()
        folded = next(f for f in written.files if f.name == "stalls.folded")
        return tracker.path, folded.read_text()


def trace_profile(argv: list[str]) -> list[tuple[str, str]]:
    """The modules that hold the first CPU sample of a real `aiflame profile ARGV` run (root, BPF), in order."""
    import threading

    from aiflame.cli.main import main

    tracker = Tracker()
    threading.setprofile(tracker)
    sys.setprofile(tracker)
    try:
        rc = main(["profile", "-q", *argv])
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    assert rc == 0, rc
    return tracker.path


def layers_reentered(modules: list[str]) -> list[str]:
    """The layers `modules` come back to after leaving them, in order."""
    left: list[str] = []
    out = []
    for module in modules:
        layer = layer_of(module)
        if left and left[-1] == layer:
            continue
        if layer in left:
            out.append(layer)
        left.append(layer)
    return out


def modules(path: list[tuple[str, str]], calls_only: bool = False) -> list[str]:
    """The modules of `path` in order, each stay once (with `calls_only`, the ones entered by a call alone)."""
    out: list[str] = []
    for m, how in path:
        if (how == "call" or not calls_only) and (not out or out[-1] != m):
            out.append(m)
    return out


def _print(path: list[tuple[str, str]]) -> None:
    for what, ms in (("calls and returns", modules(path)), ("calls alone", modules(path, calls_only=True))):
        print(f"{what}: {len(set(ms))} modules, layers re-entered: {layers_reentered(ms) or 'none'}")
        for i, m in enumerate(ms, 1):
            print(f"  {i:2d}. {layer_of(m):10s} {m}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--stalls"]:  # python -m tests.sample_path --stalls RUN_CAPTURE CUPTI_STREAM
        path, text = trace_stall_samples(Path(sys.argv[2]), Path(sys.argv[3]))
        _print(path)
        print("stalls.folded:", len(text.splitlines()), "lines")
    elif sys.argv[1:]:  # a real run: python -m tests.sample_path -o DIR --formats folded -- CMD
        _print(trace_profile(sys.argv[1:]))
    else:
        path, text = trace_cpu_sample()
        _print(path)
        print("folded:", text.strip())

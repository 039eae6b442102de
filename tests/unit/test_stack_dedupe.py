"""symbolize_capture builds each distinct raw stack once: equal samples share one Stack object, and the profile
(stacks, weights, counters, events) is exactly what building every sample on its own gives."""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterable

import pytest

from aiflame.core.model import Frame, Profile
from aiflame.core.raw import (
    Capture,
    CaptureFooter,
    CaptureHeader,
    CodeInfo,
    Mapping,
    ProcessSnapshot,
    PyCode,
    PyFlag,
    PyRuntimeInfo,
    RawEvent,
    RawPyFrame,
    RawSample,
)
from aiflame.symbolize import stacks
from aiflame.symbolize.native import NativeSymbolizer
from aiflame.symbolize.stacks import StackOptions, symbolize_capture

APP, OTHER, LIB = "/fake/app", "/fake/other", "/fake/libpython.so"
EVAL = "_PyEval_EvalFrameDefault"
# (path, file offset) -> function; return addresses are looked up at addr - 1
NAMES = {(APP, 0x100): "app_leaf", (OTHER, 0x100): "other_leaf", (LIB, 0x50): "_start", (LIB, 0x200): EVAL,
         (LIB, 0x300): "PyObject_Call"}
LEAF, EVAL_RET, CALL_RET, START_RET, ANON = 0x1100, 0x10201, 0x10301, 0x10051, 0x30010

# Native stacks, leaf first: complete with one / two evaluator frames, cut short, a broken chain, anonymous code.
ONE_EVAL = (LEAF, EVAL_RET, START_RET)
ONE_EVAL_ELSEWHERE = (LEAF + 0x80, EVAL_RET, START_RET)  # the same modules at another (unnamed) offset
TWO_EVAL = (LEAF, EVAL_RET, CALL_RET, EVAL_RET, START_RET)
SHORT = (LEAF, EVAL_RET)
BROKEN = (LEAF, 0x9999999, START_RET)
JIT = (ANON, START_RET)
USERS = [ONE_EVAL, ONE_EVAL_ELSEWHERE, TWO_EVAL, SHORT, BROKEN, JIT, ()]
KERNS = [(), (0xFFFF1, 0xFFFF2)]  # a named and an unnamed kernel address

PY310 = (RawPyFrame(0xC1, 2), RawPyFrame(0xC2, 0))  # newest first: two runs on 3.10
PY312 = (RawPyFrame(0xC1, 0), RawPyFrame(0xC9, 0, owner=3), RawPyFrame(0xC2, 0), RawPyFrame(0xC9, 0, owner=3))
PY_FLAGS = [PyFlag.TSTATE, PyFlag.TSTATE | PyFlag.TRUNCATED, 0]

SNAP_TIMES = (100, 1000, 1500)  # pid 10 maps APP, OTHER, then a rebuilt APP at 0x1000
CODE_REUSE = 500  # pid 10's code address 0xC1 named f before, g after
TIMES = (50, 60, 200, 500, 600, 1000, 1600)  # 500 and 1000 on the epoch boundaries


class _FakeSymbolizer(NativeSymbolizer):
    """Names offsets from NAMES instead of reading binaries."""

    def symbolize(self, path: str, build_id: str | None, file_offsets: Iterable[int]) -> dict[int, Frame]:
        suffix = f"@{build_id}" if build_id else ""
        return {off: Frame(NAMES[(path, off)] + suffix, module=path.rsplit("/", 1)[-1]) for off in file_offsets
                if (path, off) in NAMES}


def _maps(app: str, build_id: str = "") -> list[Mapping]:
    return [Mapping(0x1000, 0x2000, 0, app, build_id), Mapping(0x10000, 0x20000, 0, LIB),
            Mapping(0x30000, 0x31000, 0, "[anon:jit]")]


def _code(pid: int, addr: int, time_ns: int, name: str, version: tuple[int, int]) -> PyCode:
    return PyCode(pid, addr, time_ns, CodeInfo(name, f"/src/{name}.py", 10, b"", version, 0))


def _capture() -> Capture:
    cap = Capture(CaptureHeader(1, host="h", target="test", frequency_hz=19, start_mono_ns=1))
    cap.processes = [
        ProcessSnapshot(10, SNAP_TIMES[0], _maps(APP), comm="py"),
        ProcessSnapshot(10, SNAP_TIMES[1], _maps(OTHER), comm="py"),
        ProcessSnapshot(10, SNAP_TIMES[2], _maps(APP, "b2"), comm="py"),
        ProcessSnapshot(20, 0, _maps(APP)),  # no comm: samples name the process
        ProcessSnapshot(40, 0, _maps(APP), comm="py312"),
    ]  # pid 30 has no snapshot at all
    cap.kernel_symbols = {0xFFFF1: "do_syscall_64"}
    cap.py_runtimes = [PyRuntimeInfo(10, "3.10.12", "table", "/usr/bin/python3"),
                       PyRuntimeInfo(40, "3.12.1", "table", LIB)]  # pid 40's interpreter frames fold
    cap.py_codes = [_code(10, 0xC1, 0, "f", (3, 10)), _code(10, 0xC1, CODE_REUSE, "g", (3, 10)),
                    _code(10, 0xC2, 0, "h", (3, 10)),
                    _code(40, 0xC1, 0, "f12", (3, 12)), _code(40, 0xC2, 0, "h12", (3, 12))]
    samples = []
    for pid, user, kern, flags, t, tid in itertools.product((10, 20, 30, 40), USERS, KERNS, PY_FLAGS, TIMES, (1, 2)):
        py = PY312 if pid == 40 else PY310
        for comm in ("w", "x"):
            samples.append(RawSample(t, pid, pid + tid, tid, comm, user, kern, weight=tid, py=py, py_flags=flags))
        samples.append(RawSample(t, pid, pid + tid, 0, "w", user, kern, user_err=-14, py=py, py_flags=flags))
    random.Random(0).shuffle(samples)
    cap.samples = samples
    cap.events = [
        RawEvent("cuda", "__cudaRegisterFunction", "meta", 10, 11, 5, args={"func": LEAF}),
        RawEvent("cuda", "cudaLaunchKernel", "compute", 10, 11, 200, 260, TWO_EVAL, py=PY310, py_flags=PyFlag.TSTATE,
                 args={"func": LEAF}),
        RawEvent("cuda", "cudaLaunchKernel", "compute", 10, 11, 1200, 1260, TWO_EVAL, py=PY310, py_flags=PyFlag.TSTATE,
                 args={"func": LEAF}),
        RawEvent("cuda", "cudaMemcpy", "copy", 20, 21, 300, 400, ONE_EVAL, args={"bytes": 4096}),
        RawEvent("cuda", "cudaDeviceSynchronize", "sync", 30, 31, 300, 400, user_err=-14),
    ]
    # Launches with every stack twice over (the events' stacks are built once each too), their kernels named by a
    # host address in a file, in anonymous code or in no mapping.
    funcs = itertools.cycle((LEAF, ANON, 0x9999999))
    launches = [RawEvent("cuda", "cudaLaunchKernel", "compute", pid, pid + tid, t, t + 5, user,
                         user_err=0 if user else -14, py=PY312 if pid == 40 else PY310, py_flags=flags,
                         args={"func": next(funcs)})
                for pid, user, flags, t, tid in itertools.product((10, 20, 30, 40), USERS, PY_FLAGS, TIMES, (1, 2))]
    random.Random(1).shuffle(launches)
    cap.events += launches * 2
    cap.footer = CaptureFooter(counters={"lost": 3, "python_samples": 1})
    return cap


def _symbolize(cap: Capture, opts: StackOptions, dedupe: bool, monkeypatch: pytest.MonkeyPatch) -> Profile:
    with monkeypatch.context() as m:
        m.setattr(stacks, "_DEDUPE", dedupe)
        return symbolize_capture(cap, _FakeSymbolizer(), opts)


OPTIONS = [StackOptions(*o) for o in itertools.product(("none", "process", "thread"), (True, False), (True, False),
                                                       ("merged", "python", "native"), (False, True))]


@pytest.mark.parametrize("opts", OPTIONS, ids=repr)
def test_deduped_profile_equals_building_every_sample(opts: StackOptions, monkeypatch: pytest.MonkeyPatch) -> None:
    cap = _capture()
    fresh = _symbolize(cap, opts, False, monkeypatch)
    deduped = _symbolize(cap, opts, True, monkeypatch)
    assert deduped == fresh
    assert list(deduped.counters.items()) == list(fresh.counters.items())  # same keys, same order
    if opts.user and opts.python == "merged":  # the capture exercises every merge outcome
        assert all(fresh.counters[k] > 0 for k in ("python_samples", "python_spliced", "python_mismatched"))


def test_equal_raw_samples_share_one_stack_object(monkeypatch: pytest.MonkeyPatch) -> None:
    cap = _capture()
    prof = _symbolize(cap, StackOptions(group="thread"), True, monkeypatch)
    by_stack: dict[tuple[object, ...], int] = {}
    for raw, sample in zip(cap.samples, prof.samples, strict=True):
        # equal up to time within one snapshot and code epoch, cpu and weight
        epoch = (sum(t <= raw.time_ns for t in SNAP_TIMES), raw.time_ns >= CODE_REUSE)
        key = (raw.pid, raw.tid, raw.comm, raw.user, raw.kern, raw.py_flags, raw.user_err, epoch)
        assert id(sample.stack) == by_stack.setdefault(key, id(sample.stack))
    distinct = len({id(s.stack) for s in prof.samples})
    assert distinct <= len(by_stack) and distinct < len(prof.samples) / 3


def test_same_address_names_by_snapshot_and_code_object_in_force(monkeypatch: pytest.MonkeyPatch) -> None:
    cap = _capture()
    cap.samples = [RawSample(t, 10, 11, 0, "w", TWO_EVAL, (), py=PY310, py_flags=PyFlag.TSTATE) for t in TIMES] * 2
    # Every native frame shown (--native-interp), so the stack's shape is the merge's alone.
    prof = _symbolize(cap, StackOptions(group="none", kernel=False, native_interp=True), True, monkeypatch)
    leaf = {s.time_ns: (s.stack[-1].name, s.stack[3].name) for s in prof.samples}
    assert leaf == {50: ("app_leaf", "f"), 60: ("app_leaf", "f"), 200: ("app_leaf", "f"), 500: ("app_leaf", "g"),
                    600: ("app_leaf", "g"), 1000: ("other_leaf", "g"), 1600: ("app_leaf@b2", "g")}
    assert [f.name for f in prof.samples[0].stack] == ["_start", "h", "PyObject_Call", "f", "app_leaf"]
    first = prof.samples[0].stack
    assert prof.samples[1].stack is first  # 60: same snapshot and code epoch
    assert prof.samples[2].stack is first  # 200: after the first snapshot, but 0x1000 is still APP there
    assert prof.samples[3].stack is not first  # 500: f's address holds g now


def test_counters_replayed_on_every_hit(monkeypatch: pytest.MonkeyPatch) -> None:
    cap = Capture(CaptureHeader(1), processes=[ProcessSnapshot(10, 0, _maps(APP), comm="py")],
                  py_codes=[_code(10, 0xC1, 0, "f", (3, 10)), _code(10, 0xC2, 0, "h", (3, 10))],
                  py_runtimes=[PyRuntimeInfo(10, "3.10.12", "table", "/usr/bin/python3")])
    cap.samples = [RawSample(t, 10, 11, 0, "w", user, (), py=PY310, py_flags=PyFlag.TSTATE)
                   for t in range(7) for user in (TWO_EVAL, ONE_EVAL, SHORT)]
    prof = _symbolize(cap, StackOptions(), True, monkeypatch)
    assert prof.counters == {"python_samples": 21, "python_spliced": 7, "python_mismatched": 7}
    assert len({id(s.stack) for s in prof.samples}) == 3


def test_chains_that_break_alike_share_a_stack(monkeypatch: pytest.MonkeyPatch) -> None:
    cap = _capture()
    garbage = [(LEAF, EVAL_RET, 0x9999999, x, START_RET) for x in (0x1234, START_RET, 0x8888888)]
    cap.samples = [RawSample(50, 10, 11, 0, "w", user, ()) for user in garbage]
    prof = _symbolize(cap, StackOptions(group="none", kernel=False), True, monkeypatch)
    assert [f.name for f in prof.samples[0].stack] == ["[unwind stopped]", EVAL, "app_leaf"]
    assert all(s.stack is prof.samples[0].stack for s in prof.samples)


def test_interpreter_frames_fold_unless_asked_for(monkeypatch: pytest.MonkeyPatch) -> None:
    cap = _capture()
    cap.samples = [RawSample(50, 40, 41, 0, "w", TWO_EVAL, (), py=PY312, py_flags=PyFlag.TSTATE)]
    folded = _symbolize(cap, StackOptions(group="none", kernel=False), True, monkeypatch)
    shown = _symbolize(cap, StackOptions(group="none", kernel=False, native_interp=True), True, monkeypatch)
    assert [f.name for f in folded.samples[0].stack] == ["_start", "h12", "f12", "app_leaf"]
    assert [f.name for f in shown.samples[0].stack] == ["_start", "h12", "PyObject_Call", "f12", "app_leaf"]

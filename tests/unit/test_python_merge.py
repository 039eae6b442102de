"""Merging Python frames into native stacks: grouping per version, replacement, splicing, mismatches."""

from __future__ import annotations

from aiflame.core.model import Frame, FrameKind
from aiflame.core.raw import RawPyFrame
from aiflame.symbolize.python.merge import fold_interpreter, merge, python_runs


def n(name: str) -> Frame:
    return Frame(name, FrameKind.NATIVE)


def py_name(f: RawPyFrame) -> Frame:
    return Frame(f"py{f.code}", FrameKind.PYTHON)


EVAL = "_PyEval_EvalFrameDefault"


def test_runs_310_one_per_frame() -> None:
    # Oracle: by construction — 3.10 frames, one evaluator call each (CPython 3.10's ceval)
    frames = [RawPyFrame(3, 0), RawPyFrame(2, 0), RawPyFrame(1, 0)]  # newest first
    assert python_runs(frames, (3, 10), -1) == [[frames[2]], [frames[1]], [frames[0]]]


def test_runs_311_by_entry_flag() -> None:
    # Oracle: by construction — 3.11 frames marked is_entry where the evaluator was entered (CPython 3.11)
    a, b, c = RawPyFrame(1, 0, is_entry=1), RawPyFrame(2, 0), RawPyFrame(3, 0, is_entry=1)
    assert python_runs([c, b, a], (3, 11), -1) == [[a, b], [c]]


def test_runs_312_by_shim_and_shims_dropped() -> None:
    # Oracle: by construction — 3.12's shim frames (owner FRAME_OWNED_BY_CSTACK) between runs
    shim1, a, b, shim2, c = (RawPyFrame(9, 0, owner=3), RawPyFrame(1, 0), RawPyFrame(2, 0),
                             RawPyFrame(9, 0, owner=3), RawPyFrame(3, 0))
    assert python_runs([c, shim2, b, a, shim1], (3, 12), 3) == [[a, b], [c]]


def test_replace_when_counts_match() -> None:
    # Oracle: by construction — two evaluator frames and two runs, built here
    native = [n("_start"), n("main"), n(EVAL), n("PyObject_Call"), n(EVAL), n("sqrt")]
    runs = [[RawPyFrame(1, 0), RawPyFrame(2, 0)], [RawPyFrame(3, 0)]]
    r = merge(native, runs, py_name)
    assert [f.name for f in r.stack] == ["_start", "main", "py1", "py2", "PyObject_Call", "py3", "sqrt"]
    assert not r.spliced and not r.mismatched


def test_splice_when_native_stops_early() -> None:
    # Oracle: by construction — a walk cut short after one evaluator frame
    # the walk reached one evaluator frame: the newest run takes it, the older one goes at the root
    native = [n("[unknown]"), n(EVAL), n("PyNumber_Add"), n("long_add")]
    runs = [[RawPyFrame(1, 0)], [RawPyFrame(2, 0)]]
    r = merge(native, runs, py_name)
    assert [f.name for f in r.stack] == ["py1", "[unknown]", "py2", "PyNumber_Add", "long_add"]
    assert r.spliced


def test_splice_without_any_evaluator_frame_keeps_the_leaf() -> None:
    # Oracle: by construction — a walk with no evaluator frame
    r = merge([n("garbage"), n("memcpy")], [[RawPyFrame(1, 0)]], py_name)
    assert [f.name for f in r.stack] == ["py1", "memcpy"] and r.spliced


def test_mismatched_counts_on_complete_stack_are_marked() -> None:
    # Oracle: by construction — one evaluator frame for two runs
    native = [n("_start"), n(EVAL), n("x")]
    runs = [[RawPyFrame(1, 0)], [RawPyFrame(2, 0)]]
    r = merge(native, runs, py_name)
    assert r.mismatched and not r.spliced
    assert [f.name for f in r.stack] == ["py1", "py2", "x"]


def test_no_python_frames_leaves_native_alone() -> None:
    # Oracle: by construction — a stack without Python frames
    native = [n("_start"), n("main")]
    assert merge(native, [], py_name).stack == tuple(native)


def _interp(name: str, kind: FrameKind = FrameKind.NATIVE) -> Frame:
    return Frame(name, kind, module="python3.11")


def test_fold_drops_the_interpreter_frames_below_python_frames() -> None:
    # Oracle: by construction — a stack written here with CPython's own function names
    stack = [
        _interp("_start"), Frame("__libc_start_main", module="libc.so.6"), _interp("Py_BytesMain"),
        Frame("main", FrameKind.PYTHON), _interp("_PyObject_MakeTpCall"),
        _interp("python3.11+0x10a5f0", FrameKind.UNKNOWN),
        Frame("step", FrameKind.PYTHON), _interp("cfunction_call"),
        Frame("at::add", FrameKind.NATIVE_CPP, "libtorch_cpu.so"),
        _interp("PyGILState_Ensure"), _interp("take_gil"), Frame("futex_wait", FrameKind.KERNEL, "[kernel]"),
    ]
    folded = fold_interpreter(stack, "python3.11")
    # rootward of the first Python frame, the native path into Python stays as the unwinder found it
    assert [f.name for f in folded] == ["_start", "__libc_start_main", "Py_BytesMain", "main", "step", "at::add",
                                        "PyGILState_Ensure", "take_gil", "futex_wait"]


def test_fold_keeps_other_code_that_calls_into_python() -> None:
    # Oracle: by construction — libtorch's thread calling into Python, written here
    lib = "libtorch_cpu.so"
    stack = [Frame("clone3", module="libc.so.6"), Frame("start_thread", module="libc.so.6"),
             Frame("Engine::thread_main", FrameKind.NATIVE_CPP, lib), _interp("PyObject_Call"),
             _interp("thread_run"), Frame("hook", FrameKind.PYTHON), _interp("_PyObject_MakeTpCall")]
    assert [f.name for f in fold_interpreter(stack, "python3.11")] == [
        "clone3", "start_thread", "Engine::thread_main", "PyObject_Call", "thread_run", "hook"]


def test_fold_keeps_builtins_users_recognize() -> None:
    # Oracle: by construction — time.sleep and gc under a Python frame
    stack = [Frame("loop", FrameKind.PYTHON), _interp("time_sleep"), _interp("gc_collect_main"),
             _interp("visit_decref")]
    assert [f.name for f in fold_interpreter(stack, "python3.11")] == ["loop", "time_sleep", "gc_collect_main"]


def test_fold_leaves_stacks_without_python_frames_and_other_modules_alone() -> None:
    # Oracle: by construction
    no_python = [_interp("_start"), _interp("python3.11+0x10a5f0", FrameKind.UNKNOWN)]
    assert fold_interpreter(no_python, "python3.11") == tuple(no_python)
    other = [Frame("f", FrameKind.PYTHON), _interp("_PyObject_MakeTpCall")]
    assert fold_interpreter(other, "libpython3.11.so.1.0") == tuple(other)
    assert fold_interpreter(other, "") == tuple(other)


def test_walker_complete_stack_with_unnamed_root_is_replaced_in_place() -> None:
    # Oracle: by construction — a stripped interpreter's stack, as the CFI walker returns it
    # a stripped interpreter and libc: `_start` and `__libc_start_call_main` have no name, yet the CFI walker
    # reached the outermost frame; the Python runs belong at their evaluator frames, not at the root
    native = [n("python3.12+0x2c5a5"), n("libc.so.6+0x29d90"), n("Py_BytesMain"), n(EVAL), n("PyObject_Call"),
              n(EVAL), n("sqrt")]
    runs = [[RawPyFrame(1, 0)], [RawPyFrame(2, 0)]]
    r = merge(native, runs, py_name, complete=True)
    assert [f.name for f in r.stack] == ["python3.12+0x2c5a5", "libc.so.6+0x29d90", "Py_BytesMain", "py1",
                                         "PyObject_Call", "py2", "sqrt"]
    assert not r.spliced and not r.mismatched
    # judged by its unnamed root the stack looks cut short; the counts match, so the runs still go in place
    assert merge(native, runs, py_name).stack == r.stack


def test_walker_complete_stack_with_an_extra_run_is_not_taken_for_a_cut_one() -> None:
    # Oracle: by construction — one evaluator frame for two runs, complete or cut
    # complete per the walker but a run without its evaluator frame: no place is known, splice and mark it
    native = [n("libc.so.6+0x29d90"), n(EVAL), n("x")]
    runs = [[RawPyFrame(1, 0)], [RawPyFrame(2, 0)]]
    assert merge(native, runs, py_name, complete=True).mismatched
    # the same stack cut short by the walker: the newest run in place, the older at the root
    cut = merge(native, runs, py_name, complete=False)
    assert [f.name for f in cut.stack] == ["py1", "libc.so.6+0x29d90", "py2", "x"] and cut.spliced


def test_walk_cut_short_matches_runs_from_the_leaf() -> None:
    # Oracle: by construction — a walk that stopped after the two newest evaluator frames
    # the walk stopped (depth limit) after the two newest evaluator frames: the two newest runs go there, the
    # older one the walk never reached goes at the root
    native = [n("at::foo"), n(EVAL), n("torch_dispatch"), n(EVAL), n("at::add")]
    runs = [[RawPyFrame(1, 0)], [RawPyFrame(2, 0), RawPyFrame(3, 0)], [RawPyFrame(4, 0)]]
    r = merge(native, runs, py_name, complete=False)
    assert [f.name for f in r.stack] == ["py1", "at::foo", "py2", "py3", "torch_dispatch", "py4", "at::add"]
    assert r.spliced and not r.mismatched


def test_truncated_python_frames_fill_the_newest_evaluator_frames() -> None:
    # Oracle: by construction — one run for two evaluator frames
    native = [n("x"), n(EVAL), n("y"), n(EVAL), n("z")]
    r = merge(native, [[RawPyFrame(7, 0)]], py_name, complete=False)
    assert [f.name for f in r.stack] == ["x", EVAL, "y", "py7", "z"] and not r.spliced


def test_complete_walk_with_mismatched_counts_still_splices_and_is_marked() -> None:
    # Oracle: by construction — one evaluator frame for two runs
    native = [n("libc.so.6+0x29d90"), n(EVAL), n("x")]
    r = merge(native, [[RawPyFrame(1, 0)], [RawPyFrame(2, 0)]], py_name, complete=True)
    assert r.mismatched and not r.spliced
    assert [f.name for f in r.stack] == ["py1", "py2", "x"]

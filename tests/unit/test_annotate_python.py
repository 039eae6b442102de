"""`annotate` of a Python function (issue #28): its source lines with the samples the capture's Python frames put
on them, total (on the stack) and self (innermost); a name nothing matches lists the hottest of both kinds."""

from __future__ import annotations

import dis
import sys
import types
from pathlib import Path

import pytest

from aiflame.cli.main import main
from aiflame.core.capture import write_capture
from aiflame.core.errors import NothingToShow
from aiflame.core.raw import (
    Capture,
    CaptureFooter,
    CodeInfo,
    PyCode,
    PyRuntimeInfo,
    RawPyFrame,
    RawSample,
)
from aiflame.symbolize.annotate import annotate_any
from aiflame.symbolize.annotate.python import PythonAnnotation
from tests.unit.test_capture import _capture

SOURCE = '''\
import time


def inner(n):
    s = 0
    for i in range(n):
        s += i * i
    return s


@staticmethod
def outer():
    return inner(10)
'''
PID = 7


def _code(module: types.CodeType, name: str) -> types.CodeType:
    return next(c for c in module.co_consts if isinstance(c, types.CodeType) and c.co_name == name)


def _instr(code: types.CodeType, line: int) -> int:
    """The instruction position a walker reads for the first instruction of `line` (see python/code.py)."""
    offset = next(off for off, ln in dis.findlinestarts(code) if ln == line)
    return offset if sys.version_info >= (3, 11) else offset // 2


def _info(code: types.CodeType, path: Path) -> CodeInfo:
    return CodeInfo(code.co_qualname if sys.version_info >= (3, 11) else code.co_name, str(path),
                    code.co_firstlineno, code.co_linetable, sys.version_info[:2], 0)


@pytest.fixture
def capture(tmp_path: Path) -> Path:
    src = tmp_path / "hot.py"
    src.write_text(SOURCE)
    module = compile(SOURCE, str(src), "exec")
    inner, outer = _code(module, "inner"), _code(module, "outer")
    codes = [PyCode(PID, 0x1000, 0, _info(inner, src)), PyCode(PID, 0x2000, 0, _info(outer, src))]

    def sample(inner_line: int | None, n: int) -> list[RawSample]:
        py = ((RawPyFrame(0x1000, _instr(inner, inner_line)),) if inner_line else ()) + \
            (RawPyFrame(0x2000, _instr(outer, 13), is_entry=1),)
        return [RawSample(i, PID, PID, 0, "python", (), (), py=py) for i in range(n)]

    base = _capture([])
    samples = [*sample(7, 6), *sample(6, 3), *sample(None, 1),
               RawSample(0, PID, PID, 0, "python", (), ())]  # one without Python frames
    version = ".".join(map(str, sys.version_info[:3]))
    cap = Capture(base.header, samples, [], {}, codes, [PyRuntimeInfo(PID, version, "test", "/usr/bin/python")],
                  footer=CaptureFooter())
    path = tmp_path / "c.aiflame"
    write_capture(path, cap)
    return path


def test_lines_of_a_python_function(capture: Path) -> None:
    # Oracle: CPython's compiler (dis.findlinestarts of the compiled source); counts placed by construction
    from aiflame.core.capture import read_capture

    cap = read_capture(capture)
    ann = annotate_any(cap, "inner")
    assert isinstance(ann, PythonAnnotation)
    assert (ann.qualname, ann.firstlineno, ann.samples, ann.self_samples, ann.total) == ("inner", 4, 9, 9, 11)
    assert [ln.line for ln in ann.lines] == [4, 5, 6, 7, 8]  # the whole def, from the source's syntax tree
    by_line = {ln.line: (ln.total, ln.self_, ln.hot, ln.text) for ln in ann.lines}
    assert by_line[7] == (6, 6, 1, "        s += i * i") and by_line[6] == (3, 3, 2, "    for i in range(n):")
    assert by_line[5] == (0, 0, 0, "    s = 0")
    assert sum(ln.percent for ln in ann.lines) == pytest.approx(100)
    outer = annotate_any(cap, "outer")  # decorated: its code starts at the decorator
    assert isinstance(outer, PythonAnnotation) and outer.firstlineno == 11
    assert [(ln.line, ln.total, ln.self_) for ln in outer.lines if ln.total] == [(13, 10, 1)]
    assert [ln.line for ln in outer.lines] == [11, 12, 13]


def test_annotate_command_prints_the_lines(capture: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Oracle: by construction — 6 samples on line 7 and 3 on line 6 of SOURCE (dis's offsets)
    assert main(["annotate", str(capture), "inner"]) == 0
    out = capsys.readouterr().out
    assert "inner  " in out and "hot.py:4 (Python)" in out
    assert "9 samples with it on the stack (81.8% of the capture's 11), 9 with it the innermost Python frame" in out
    row = next(line for line in out.splitlines() if line.rstrip().endswith("s += i * i"))
    assert row.split()[:5] == [">1", "66.67", "6", "6", "7"]
    assert main(["annotate", str(capture), "inner", "-s", "samples"]) == 0
    rows = [line.split()[:5] for line in capsys.readouterr().out.splitlines() if line.startswith(">")]
    assert rows == [[">1", "66.67", "6", "6", "7"], [">2", "33.33", "3", "3", "6"]]


def test_a_name_nothing_matches_lists_the_hottest_of_both_kinds(capture: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    from aiflame.core.capture import read_capture

    with pytest.raises(NothingToShow, match=r"no Python function matching either \(sampled Python functions: "
                                            r"inner 81\.8%, outer 9\.1%\)"):
        annotate_any(read_capture(capture), "nosuch")
    assert main(["annotate", str(capture), "nosuch"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("aiflame: error: ") and err.count("\n") == 1 and "inner 81.8%" in err
    assert main(["annotate", str(capture), "inner", "--kind", "native"]) == 1  # native code only: none sampled
    assert capsys.readouterr().err == "aiflame: error: the capture has no user-mode samples in any binary\n"

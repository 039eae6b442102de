"""Code objects read out of real CPython processes (every pyenv build present, and Debian's python3), and the
line-table decoders checked against each interpreter's own idea of instruction -> line."""

from __future__ import annotations

import json
import os
import subprocess
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aiflame.core.errors import TargetGone, Unreadable
from aiflame.core.python_layouts import PyLayout, layout_for
from aiflame.core.raw import CodeInfo
from aiflame.symbolize.process_memory import ProcessMemory
from aiflame.symbolize.python.code import (
    CodeResolver,
    decode_unicode,
    line_for,
)
from tests.conftest import INTERPRETERS

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# Runs in the child. Prints one JSON line describing code objects (address, names, the line of every code
# unit as the interpreter itself computes it), then keeps them alive until stdin closes.
CHILD = textwrap.dedent(r'''
    import json, sys

    class Outer:
        def hot(self, n):
            total = 0
            for i in range(n):
                total += i * i  # HOT
            return total

    def функция_é(x):
        return (x +
                1)

    src = "def emoji_file():\n    return 1\n"
    ns = {}
    exec(compile(src, "/tmp/\U0001F600файл.py", "exec"), ns)
    keep = [Outer.hot.__code__, функция_é.__code__, ns["emoji_file"].__code__]

    def walk(code):
        yield code
        for c in code.co_consts:
            if hasattr(c, "co_code"):
                yield from walk(c)

    import argparse  # a large module: many location-table forms
    with open(argparse.__file__) as f:
        keep.extend(walk(compile(f.read(), argparse.__file__, "exec")))

    v = sys.version_info[:2]
    out = []
    for code in keep:
        if v >= (3, 11):
            units = [p[0] for p in code.co_positions()]
            assert len(units) == len(code.co_code) // 2
        else:
            units = [None] * (len(code.co_code) // 2)
            for start, end, line in code.co_lines():
                for off in range(start, end, 2):
                    units[off // 2] = line
        out.append(dict(addr=id(code), name=code.co_name, qualname=getattr(code, "co_qualname", code.co_name),
                        filename=code.co_filename, firstlineno=code.co_firstlineno, units=units,
                        co_code=code.co_code.hex()))
    print(json.dumps(dict(version=list(v), codes=out)), flush=True)
    sys.stdin.readline()
''')


@dataclass
class Child:
    proc: subprocess.Popen[str]
    version: tuple[int, int]
    codes: list[dict[str, Any]]

    @property
    def layout(self) -> PyLayout:
        lay = layout_for(self.version)
        assert lay is not None
        return lay


def _interpreters() -> list[Any]:
    found: list[Any] = [p for p in INTERPRETERS if os.path.exists(p)]
    return found or [pytest.param("", marks=pytest.mark.skip(reason="no CPython interpreters on this machine"))]


@pytest.fixture(scope="module", params=_interpreters())
def child(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Child]:
    if os.geteuid() != 0:
        pytest.fail("reading another process's memory needs root")
    script = tmp_path_factory.mktemp("py") / "child.py"
    script.write_text(CHILD, encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env["PYTHONIOENCODING"] = "utf-8"
    proc = subprocess.Popen([request.param, str(script)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, encoding="utf-8", env=env)
    try:
        assert proc.stdout is not None
        data = json.loads(proc.stdout.readline())
        yield Child(proc, (data["version"][0], data["version"][1]), data["codes"])
    finally:
        proc.kill()
        proc.wait()


def test_resolve_names(child: Child) -> None:
    # Oracle: each interpreter's own code objects (co_qualname, co_filename, co_firstlineno), printed by the child
    with CodeResolver(child.proc.pid, child.layout) as r:
        for c in child.codes[:3]:
            info = r.resolve(c["addr"])
            assert info is not None
            assert info.qualname == c["qualname"]
            assert info.filename == c["filename"]
            assert info.firstlineno == c["firstlineno"]
            assert info.version == child.version
            assert r.resolve(c["addr"]) is info  # cached, and the cache re-validates the header
    hot = child.codes[0]
    assert hot["qualname"] == ("Outer.hot" if child.version >= (3, 11) else "hot")
    assert child.codes[1]["qualname"] == "функция_é"  # kind 2 (and kind 1 non-ASCII in the name)
    assert child.codes[2]["filename"] == "/tmp/\U0001f600файл.py"  # kind 4


def test_every_instruction_line(child: Child) -> None:
    """line_for agrees with the interpreter for every code unit of every code object, under the convention
    the BPF side uses (3.10: f_lasti; 3.11+: byte offset of the instruction from the code object)."""
    # Oracle: each interpreter's own instruction -> line map (co_lines / co_lnotab), printed by the child
    lay = child.layout
    checked = 0
    with CodeResolver(child.proc.pid, lay) as r:
        for c in child.codes:
            info = r.resolve(c["addr"])
            assert info is not None, c["qualname"]
            for i, line in enumerate(c["units"]):
                want = line if line is not None and line > 0 else c["firstlineno"]
                instr = i if child.version < (3, 11) else lay.code_code_adaptive + 2 * i
                assert line_for(info, instr) == want, (c["qualname"], i)
                checked += 1
            # Before the first instruction (3.10 f_lasti -1; 3.11/3.12 prev_instr one unit early).
            early = -1 if child.version < (3, 11) else lay.code_code_adaptive - 2
            assert line_for(info, early) == c["firstlineno"]
    assert checked > 5000


def test_hot_line(child: Child) -> None:
    # Oracle: the child's source (the hot line is its function's fourth line) and its own line map
    hot = child.codes[0]
    lay = child.layout
    with CodeResolver(child.proc.pid, lay) as r:
        info = r.resolve(hot["addr"])
    assert info is not None
    hot_line = hot["firstlineno"] + 3
    units = [i for i, ln in enumerate(hot["units"]) if ln == hot_line]
    assert units
    for i in units:
        instr = i if child.version < (3, 11) else lay.code_code_adaptive + 2 * i
        assert line_for(info, instr) == hot_line


def test_code_adaptive_offset_holds_the_bytecode(child: Child) -> None:
    """The bytecode is where the table says: inline at co_code_adaptive (3.11+; opcodes of a never-run function
    match co_code), or in the bytes object co_code points to (3.10)."""
    # Oracle: the child's own co_code bytes, printed by it
    c = child.codes[2]  # emoji_file: never called, so never specialised
    code = bytes.fromhex(c["co_code"])
    with ProcessMemory(child.proc.pid) as mem:
        if child.version < (3, 11):
            bytes_obj = mem.u64(c["addr"] + child.layout.code_code)
            assert mem.read(bytes_obj + child.layout.bytes_sval, len(code)) == code
            return
        live = mem.read(c["addr"] + child.layout.code_code_adaptive, len(code))
    assert live[0::2] == code[0::2]


def test_resolve_rejects_non_code(child: Child) -> None:
    with CodeResolver(child.proc.pid, child.layout) as r:
        c = child.codes[0]
        assert r.resolve(c["addr"] + 8) is None  # garbage type pointer
        assert r.resolve(16) is None  # unmapped
        assert r.resolve(1 << 62) is None


def test_resolver_on_dead_process() -> None:
    proc = subprocess.Popen(["true"])
    proc.wait()
    lay = layout_for((3, 12))
    assert lay is not None
    assert CodeResolver(proc.pid, lay).resolve(0x1000) is None
    with pytest.raises(TargetGone):
        ProcessMemory(proc.pid)


# --- garbage in -------------------------------------------------------------------------------------------

LAYOUTS = [lay for v in ((3, 10), (3, 11), (3, 12), (3, 13)) if (lay := layout_for(v)) is not None]


@FUZZ
@given(st.sampled_from(LAYOUTS), st.binary(max_size=200), st.integers(-(1 << 40), 1 << 40), st.integers(-5, 10**6))
def test_line_for_never_raises(lay: PyLayout, table: bytes, instr: int, first: int) -> None:
    info = CodeInfo("f", "f.py", first, table, lay.version, max(lay.code_code_adaptive, 0))
    line = line_for(info, instr)
    assert isinstance(line, int)
    if not table:
        assert line == first


@FUZZ
@given(st.sampled_from(LAYOUTS), st.binary(min_size=1, max_size=512), st.integers(0, 600))
def test_decode_unicode_garbage(lay: PyLayout, blob: bytes, addr: int) -> None:
    def read(a: int, n: int) -> bytes:
        if a < 0 or n < 0 or a + n > len(blob):
            raise TargetGone("out of range")
        return blob[a : a + n]

    try:
        s = decode_unicode(read, addr, lay)
    except (Unreadable, TargetGone):
        return
    assert isinstance(s, str)


def _compact(lay: PyLayout, text: str) -> bytes:
    """A compact str object as CPython lays it out, for the decoder's happy paths."""
    mx = max((ord(ch) for ch in text), default=0)
    kind = 1 if mx < 256 else 2 if mx < 65536 else 4
    is_ascii = mx < 128
    state = (kind << lay.unicode_kind_shift) | (1 << lay.unicode_compact_shift) | (is_ascii << lay.unicode_ascii_shift)
    head = bytearray(lay.unicode_ascii_size if is_ascii else lay.unicode_compact_size)
    head[lay.unicode_length : lay.unicode_length + 8] = len(text).to_bytes(8, "little")
    head[lay.unicode_state : lay.unicode_state + 4] = state.to_bytes(4, "little")
    enc = {1: "latin-1", 2: "utf-16-le", 4: "utf-32-le"}[kind]
    return bytes(head) + text.encode(enc, "surrogatepass") + b"\0" * 64


@FUZZ
@given(st.sampled_from(LAYOUTS), st.text(st.characters(codec=None, exclude_categories=()), max_size=50))
def test_decode_unicode_roundtrip(lay: PyLayout, text: str) -> None:
    # Oracle: CPython's compact unicode layout, laid out by hand here (_compact) for each version
    blob = _compact(lay, text)
    assert decode_unicode(lambda a, n: blob[a : a + n], 0, lay) == text

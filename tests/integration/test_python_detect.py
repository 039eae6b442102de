"""detect_python against real interpreters: version, `_PyRuntime` address, live checks, thread matching, and
the instruction convention of a live frame (what the BPF walker reads) mapped to the right source line."""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import textwrap
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from aiflame.agent.python.detect import (
    PythonNotLoaded,
    detect_python,
    python_threads,
    read_python_stack,
)
from aiflame.agent.python.runtime import PythonPlugin
from aiflame.core.errors import HostError
from aiflame.symbolize.process_memory import ProcessMemory
from aiflame.symbolize.python.code import CodeResolver, line_for
from tests.conftest import INTERPRETERS

UNSUPPORTED = "/root/.pyenv/versions/3.9.18/bin/python"

# The main thread blocks in readline() on the CALL of line `waiter + 2`; the next instruction (STORE_FAST)
# belongs to line `waiter + 1`, so an off-by-one in the instruction convention shows as a wrong line.
CHILD = textwrap.dedent(r'''
    import ctypes, json, sys, threading, time

    def spin():
        while True:
            time.sleep(0.01)

    t = threading.Thread(target=spin, daemon=True)
    t.start()

    def waiter():
        x = (
            sys.stdin.readline()
        )
        return x

    runtime = ctypes.addressof(ctypes.c_char.in_dll(ctypes.pythonapi, "_PyRuntime"))
    print(json.dumps(dict(version=list(sys.version_info[:3]), runtime=runtime, tids=[threading.get_native_id(),
                          t.native_id], waiter=id(waiter.__code__), waiter_line=waiter.__code__.co_firstlineno,
                          module=id(sys._getframe().f_code), call_line=sys._getframe().f_lineno + 1)), flush=True)
    waiter()
''')


@dataclass
class Child:
    proc: subprocess.Popen[str]
    info: dict[str, Any]
    exe: str


def _spawn(exe: str, script: Path) -> Child:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    proc = subprocess.Popen([exe, str(script)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout is not None
    info = json.loads(proc.stdout.readline())
    time.sleep(0.1)  # let the main thread reach readline()
    return Child(proc, info, exe)


@pytest.fixture(params=[p for p in INTERPRETERS if os.path.exists(p)])
def child(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Child]:
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    c = _spawn(request.param, script)
    try:
        yield c
    finally:
        c.proc.kill()
        c.proc.wait()


def test_detect(child: Child) -> None:
    # Oracle: each interpreter's own report (sys.version_info, the _PyRuntime symbol's address), printed by the child
    t = detect_python(child.proc.pid)
    assert t is not None
    want = tuple(child.info["version"])
    assert t.version[:2] == want[:2]
    assert t.version[2] == (0 if want[:2] == (3, 10) else want[2])  # 3.10 keeps no patch level as data
    assert t.runtime_addr == child.info["runtime"]
    assert t.layout.version == want[:2]
    assert t.warnings == ()
    if want[:2] >= (3, 13):
        assert t.layout.source == "debug_offsets"
    assert os.path.basename(t.binary).startswith("libpython3" if "pyenv" in child.exe else "python3")
    assert t.tid_offset == (720 if want[:2] == (3, 10) else -1)


def test_threads_and_live_frame_lines(child: Child) -> None:
    """Walk the blocked main thread like the BPF side does and map (code, instr) to lines."""
    # Oracle: the child's own thread ids, code object addresses and source lines, printed by it
    t = detect_python(child.proc.pid)
    assert t is not None
    with ProcessMemory(child.proc.pid) as mem, CodeResolver(child.proc.pid, t.layout) as resolver:
        threads = python_threads(t, mem)
        assert set(child.info["tids"]) <= set(threads)
        stack = read_python_stack(mem, threads[child.proc.pid], t.layout)
        assert len(stack) == 2, stack
        (leaf_code, leaf_instr), (root_code, root_instr) = stack
        assert leaf_code == child.info["waiter"] and root_code == child.info["module"]
        leaf = resolver.resolve(leaf_code)
        root = resolver.resolve(root_code)
        assert leaf is not None and root is not None
        assert leaf.qualname == "waiter" and root.qualname == "<module>"
        assert line_for(leaf, leaf_instr) == child.info["waiter_line"] + 2
        assert line_for(root, root_instr) == child.info["call_line"]


def test_not_python() -> None:
    proc = subprocess.Popen(["sleep", "30"])
    try:
        time.sleep(0.05)
        assert detect_python(proc.pid) is None
    finally:
        proc.kill()
        proc.wait()


PTRACE_TRACEME, PTRACE_DETACH = 0, 17


def test_read_before_libpython_is_mapped_is_asked_again() -> None:
    """A process read between its exec and the loader mapping libpython (pyenv builds keep the runtime there)
    is not recorded as holding no CPython: a later attach finds it. It was, and `profile -- sh -c 'exec
    python3.10 ...'` then lost every Python frame of that process when the agent read it early."""
    # Oracle: by construction — python3.10 stopped at its exec, before libpython is mapped
    libc = ctypes.CDLL(None, use_errno=True)
    proc = subprocess.Popen([INTERPRETERS[0], "-c", "import time; time.sleep(30)"],
                            preexec_fn=lambda: libc.ptrace(PTRACE_TRACEME, 0, None, None))
    try:
        _, status = os.waitpid(proc.pid, 0)  # stopped at the exec: the executable and ld.so are all it maps
        assert os.WIFSTOPPED(status)
        with pytest.raises(PythonNotLoaded):
            detect_python(proc.pid)
        plugin = PythonPlugin()
        assert plugin.attach(proc.pid, 0) is None
        libc.ptrace(PTRACE_DETACH, proc.pid, None, None)
        deadline = time.monotonic() + 20
        while (found := plugin.attach(proc.pid, 0, force=True)) is None and time.monotonic() < deadline:
            time.sleep(0.05)  # until it has mapped libpython and initialised
        assert found is not None and found[0].version[:2] == (3, 10)
    finally:
        proc.kill()
        proc.wait()


def test_gone_process() -> None:
    proc = subprocess.Popen(["true"])
    proc.wait()
    assert detect_python(proc.pid) is None


@pytest.mark.skipif(not os.path.exists(UNSUPPORTED), reason="no pyenv 3.9")
def test_unsupported_version(tmp_path: Path) -> None:
    script = tmp_path / "child.py"
    script.write_text("import sys\nprint('ready', flush=True)\nsys.stdin.readline()\n")
    proc = subprocess.Popen([UNSUPPORTED, str(script)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        proc.stdout.readline()
        with pytest.raises(HostError, match=r"CPython 3\.9 .*no verified struct layout") as e:
            detect_python(proc.pid)
        assert "\n" not in str(e.value)
    finally:
        proc.kill()
        proc.wait()

"""A CPU sample inside a call with a return probe keeps its callers: while such a call runs the kernel has put its
uretprobe trampoline where the return address was, and the CFI walk takes the original back from what the entry
probe kept (bpf/walk.h, uret_ras). Before that, every such sample ended at `[uprobes]`."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from aiflame.core.capture import read_capture
from tests.conftest import PROGRAMS
from tests.integration.conftest import aiflame, read_folded


@pytest.mark.parametrize("cet", ["none", "full"])
def test_samples_inside_a_return_probed_call_keep_their_callers(tmp_path: Path, cet: str) -> None:
    """With -fcf-protection=full the library's functions start with endbr64, and the probes go in 4 bytes past
    it (agent/kernel/uprobes.py entry_offset): the call, its return and its callers are the same."""
    # Oracle: the program's own structure (main calls the probed function, which spins)
    lib_dir = tmp_path / "lib"
    lib_dir.mkdir()
    subprocess.run(["gcc", "-O1", "-g", "-fomit-frame-pointer", f"-fcf-protection={cet}", "-shared", "-fPIC",
                    "-Wl,-soname,libnccl.so.2",
                    "-o", str(lib_dir / "libnccl.so.2"), str(PROGRAMS / "uret_lib.c")], check=True)
    exe = tmp_path / "uret_main"
    subprocess.run(["gcc", "-O1", "-g", "-fomit-frame-pointer", "-o", str(exe), str(PROGRAMS / "uret_main.c"),
                    str(lib_dir / "libnccl.so.2"), f"-Wl,-rpath,{lib_dir}"], check=True)
    out = tmp_path / "out"
    aiflame("profile", "-q", "-F", "499", "-o", str(out), "--formats", "folded", "--", str(exe), "1500")
    cap = read_capture(out / "profile.aiflame")
    calls = [e for e in cap.events if e.runtime == "nccl" and e.call == "ncclAllReduce"]
    assert len(calls) == 1 and calls[0].end_ns, calls  # probed at entry and return
    # as passed, the stream the 7th argument (read at SP+8: where the probe sits must not have moved sp)
    assert {k: calls[0].args[k] for k in ("dtype", "bytes", "ret", "stream")} == {
        "dtype": 7, "bytes": 1500 * 4, "ret": 0, "stream": 0x5151}
    inside = {stack: n for stack, n in read_folded(out / "profile.folded").items() if "ncclAllReduce" in stack}
    total = sum(inside.values())
    assert total > 300, inside
    whole = sum(n for stack, n in inside.items() if ";main;caller;ncclAllReduce" in stack)
    assert whole >= 0.98 * total, inside
    assert not any("[uprobes];ncclAllReduce" in stack for stack in inside), inside

"""Past code without CFI: a walk that reaches a function no .eh_frame FDE covers, with no frame pointer to follow
(hand-written kernels such as MKL's sgemm in libtorch), scans the stack for its return address. The truth is the
program's own structure: main -> outer -> nocfi_spin (tests/programs/unwind_scan.c, unwind_nocfi.s)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from aiflame.core.capture import read_capture
from aiflame.core.unwind import END, USED_SCAN, stop_of
from tests.conftest import REPO
from tests.integration.conftest import aiflame, read_folded

PROGRAMS = REPO / "tests" / "programs"


def test_a_walk_goes_on_past_a_function_without_cfi(tmp_path: Path) -> None:
    # Oracle: the program's own structure (main -> outer -> nocfi_spin); readelf --debug-dump=frames
    exe = tmp_path / "unwind_scan"
    subprocess.run(["gcc", "-O1", "-g", "-fomit-frame-pointer", "-o", str(exe), str(PROGRAMS / "unwind_scan.c"),
                    str(PROGRAMS / "unwind_nocfi.s")], check=True)
    fdes = subprocess.run(["readelf", "--debug-dump=frames", str(exe)], capture_output=True, text=True).stdout
    assert "nocfi_spin" not in fdes and fdes.count("FDE") >= 2  # outer and main have CFI, nocfi_spin none
    out = tmp_path / "out"
    aiflame("profile", "-q", "-F", "499", "-o", str(out), "--formats", "folded", "--", str(exe), "1.5")
    in_spin = {stack: n for stack, n in read_folded(out / "profile.folded").items() if stack.endswith(";nocfi_spin")}
    total = sum(in_spin.values())
    assert total > 300, in_spin
    whole = sum(n for stack, n in in_spin.items() if ";__libc_start_call_main;main;outer;nocfi_spin" in stack)
    # Start-up samples may stop in libc before the agent has described its mapping (the 0.5 s re-read), but every
    # one has main -> outer above the function without CFI, and none has anything else there.
    assert whole == total, in_spin
    cap = read_capture(out / "profile.aiflame")
    walked = [s for s in cap.samples if s.comm.startswith("unwind_scan") and stop_of(s.unwind)]
    scanned = [s for s in walked if s.unwind & USED_SCAN]
    assert len(scanned) >= 0.95 * total
    assert sum(1 for s in scanned if stop_of(s.unwind) == END) >= 0.85 * len(scanned)


@pytest.mark.parametrize("frame", ["leaf", "big"])
def test_a_walk_goes_on_past_jit_code(tmp_path: Path, frame: str) -> None:
    """JIT code (anonymous executable memory, as oneDNN's kernels in libtorch) has no CFI and its rbp means
    nothing: the agent marks such memory for BPF, which scans past it from the leaf. "big": the kernel's frame
    holds 256 words of spills, more than one scan's tail call reads."""
    # Oracle: the program's own structure (main -> outer -> the code it copied into anonymous memory)
    exe = tmp_path / "unwind_jit"
    subprocess.run(["gcc", "-O1", "-g", "-fomit-frame-pointer", "-o", str(exe), str(PROGRAMS / "unwind_jit.c")],
                   check=True)
    out = tmp_path / "out"
    aiflame("profile", "-q", "-F", "499", "-o", str(out), "--formats", "folded", "--", str(exe), "1.5", frame)
    folded = read_folded(out / "profile.folded")
    in_jit = {stack: n for stack, n in folded.items() if stack.endswith(";[anon]")}
    whole = sum(n for stack, n in in_jit.items() if ";__libc_start_call_main;main;outer;[anon]" in stack)
    assert whole > 300, folded
    # The JIT code is mapped after the start: until the agent has read that mapping (on the first sample outside
    # the known ones) a walk stops at the leaf. Once one walk got through, every later one must.
    cap = read_capture(out / "profile.aiflame")
    mine = sorted((s for s in cap.samples if s.comm.startswith("unwind_jit")), key=lambda s: s.time_ns)
    first = next(s.time_ns for s in mine if s.unwind & USED_SCAN and stop_of(s.unwind) == END)
    # A leaf in the vdso (clock_gettime, between the CPU-time checks) is outside every mapping BPF is given, by
    # design: it stops there whatever the JIT code.
    vdso = [(m.start, m.end) for p in cap.processes for m in p.mappings if m.path == "[vdso]"]
    later = [s for s in mine if s.time_ns > first and not (s.user and any(a <= s.user[0] < b for a, b in vdso))]
    assert not [s for s in later if len(s.user) == 1 and stop_of(s.unwind) != END], "leaf-only after the first whole"
    scanned = [s for s in later if s.unwind & USED_SCAN]
    assert sum(1 for s in scanned if stop_of(s.unwind) == END) >= 0.95 * len(scanned)

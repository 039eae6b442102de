"""Level Zero USDT probes (iaprof's level_zero:launch_kernel / compile_kernel) on a real program: tests/programs/
ze_usdt.c fires them at -O2 with arguments in argument registers, other registers, stack memory and constants,
and prints each one that fired. The capture must carry exactly those values, they must map EU-stall IPs to the
kernels, and the semaphore-guarded compile_kernel site fires only because the probe raised its semaphore."""

from __future__ import annotations

import subprocess
from collections import Counter
from pathlib import Path

import pytest

from aiflame.core.capture import read_capture
from aiflame.core.raw import Capture, RawEvent, RawStallSample
from aiflame.symbolize.objfmt.elf import ElfFile
from aiflame.symbolize.objfmt.usdt import REGISTERS, read_notes
from aiflame.symbolize.vendor.xe_eu_stall import map_ips, xe_kernels_from_events
from tests.conftest import REPO
from tests.integration.conftest import aiflame

SOURCE = REPO / "tests" / "programs" / "ze_usdt.c"


@pytest.fixture(scope="module")
def program(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("ze_usdt") / "ze_usdt"
    cmd = ["gcc", "-O2", "-g", "-fno-omit-frame-pointer", "-o", str(out), str(SOURCE)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.fail(f"gcc failed (needs systemtap-sdt-dev, `make setup`): {' '.join(cmd)}\n{proc.stderr}")
    return out


@pytest.fixture(scope="module")
def run(program: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[list[str], Capture]:
    out = tmp_path_factory.mktemp("ze_usdt_profile")
    proc = aiflame("profile", "-o", str(out), "-q", "--formats", "folded", "--", str(program))
    return proc.stdout.splitlines(), read_capture(out / "profile.aiflame")


def _usdt(cap: Capture, call: str) -> list[RawEvent]:
    return [e for e in cap.events if e.runtime == "level_zero" and e.call == call]


def test_notes_match_readelf(program: Path) -> None:
    # Oracle: readelf -n (the stapsdt notes)
    text = subprocess.run(["readelf", "-n", str(program)], capture_output=True, text=True, check=True).stdout
    expected = []
    for block in text.split("Provider: ")[1:]:
        lines = block.splitlines()
        loc = lines[2].split()
        expected.append((lines[0].strip(), lines[1].split(":")[1].strip(), int(loc[1].rstrip(","), 16),
                         int(loc[5], 16), lines[3].split(":", 1)[1].strip()))
    with ElfFile.open(program) as elf:
        notes = read_notes(elf)
        assert [(n.provider, n.name, n.pc, n.semaphore, n.args_text) for n in notes] == expected
        for n in notes:
            assert n.offset == elf.vaddr_to_file_offset(n.pc) and n.semaphore_offset > 0
    kinds = {(a.kind, REGISTERS[a.reg] if a.reg >= 0 else "") for n in notes for a in n.args}
    assert {k for k, _ in kinds} == {"reg", "mem", "const"}
    assert any(k == "reg" and r not in ("rdi", "rsi", "rdx", "rcx", "r8", "r9") for k, r in kinds), kinds


def test_launches_carry_exact_values(run: tuple[list[str], Capture]) -> None:
    # Oracle: the program's printout of every probe that fired, with its values
    lines, cap = run
    printed = Counter(tuple(line.split()[1:]) for line in lines if line.startswith("launch "))
    assert sum(printed.values()) == 6
    seen = Counter((hex(e.args["iba"]), hex(e.args["kernel_va"]), hex(e.args["kernel_size"]), e.strs["name"])
                   for e in _usdt(cap, "level_zero:launch_kernel"))
    assert seen == printed
    for e in _usdt(cap, "level_zero:launch_kernel"):
        assert e.kind == "meta" and len(e.user) >= 2


def test_semaphore_guarded_compile_fires(run: tuple[list[str], Capture]) -> None:
    # Oracle: the program's printout: the compile site runs only when its semaphore is raised
    lines, cap = run
    assert "compile /tmp/aiflame-test/kernels.debug.zebin" in lines  # the probe raised the semaphore
    (ev,) = _usdt(cap, "level_zero:compile_kernel")
    assert ev.strs["debug_zebin"] == "/tmp/aiflame-test/kernels.debug.zebin"


def test_eu_stall_ips_map_to_the_kernels(run: tuple[list[str], Capture]) -> None:
    # Oracle: the program's printout (each kernel's address and size); IPs built here
    _, cap = run
    kernels = xe_kernels_from_events(cap.events)
    assert {(k.name, k.start, k.size, k.iba) for k in kernels} >= {
        ("gemm_tile", 0x800000001000, 0x400, 0x800000000000),
        ("layer_norm", 0x900000000040, 0x1000, 0x900000000000),
        ("const_kernel", 0xa00000002000, 0x80, 0xa00000000000)}

    def sample(va: int, iba: int) -> RawStallSample:
        return RawStallSample("xe", 0, 0, "", "", (va - iba) >> 3, "active", 5)
    samples = [sample(0x800000001000 + 0x18, 0x800000000000), sample(0x900000000060 + 0x800, 0x900000000000),
               sample(0xa00000002000 + 0x40, 0xa00000000000), sample(0xa00000002000 + 0x80, 0xa00000000000)]
    mapped, unmapped = map_ips(samples, kernels)
    assert [(s.kernel, s.offset) for s in mapped[:3]] == [("gemm_tile", 0x18), ("layer_norm", 0x800),
                                                          ("const_kernel", 0x40)]
    assert unmapped == 5 and mapped[3].kernel == ""

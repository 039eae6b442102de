"""CUDA runtime probes on real programs built with NVIDIA's compiler (no GPU: every call fails after the runtime
was entered, which is all the probes need). tests/cuda/kernels.cu makes a fixed set of calls; each build
variant must show exactly those, with their arguments and launch stacks."""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import pytest

from aiflame.core.capture import read_capture
from aiflame.core.model import EventKind, FrameKind, Profile
from aiflame.symbolize.stacks import StackOptions, symbolize_capture
from tests.cuda_build import CUDA_RET, KernelPrograms, kernel_programs
from tests.integration.conftest import aiflame, read_folded


@pytest.fixture(scope="module")
def programs(tmp_path_factory: pytest.TempPathFactory) -> KernelPrograms:
    return kernel_programs(tmp_path_factory)


def _profile(out: Path, *cmd: str) -> Profile:
    aiflame("profile", "-o", str(out), "-q", "--formats", "folded", "--", *cmd)
    return symbolize_capture(read_capture(out / "profile.aiflame"), options=StackOptions(group="none"))


def _check_kernels_program(prof: Profile) -> None:
    launches = [e for e in prof.events if e.kind == EventKind.COMPUTE]
    assert Counter(e.name for e in launches) == {"scale": 3, "add": 1}
    for e in launches:
        dims = tuple(e.args[k] for k in ("grid_x", "grid_y", "grid_z", "block_x", "block_y", "block_z", "shmem"))
        assert dims == ((4, 1, 1, 256, 1, 1, 0) if e.name == "scale" else (2, 3, 1, 32, 4, 1, 128))
        assert e.args["ret"] == CUDA_RET  # here cudaErrorInsufficientDriver: the runtime ran, the GPU is absent
        assert e.duration_ns > 0
        names = [f.name for f in e.stack]
        helper = "launch_scale" if e.name == "scale" else "launch_add"
        assert names.index("main") < names.index("run_steps") < names.index(helper), names
    copies = sorted((e.args["direction"], e.args["bytes"]) for e in prof.events if e.kind == EventKind.COPY)
    assert copies == [("DtoH", 4096), ("HtoD", 4096)]
    syncs = [e.name for e in prof.events if e.kind == EventKind.SYNC]
    assert syncs == ["cudaDeviceSynchronize"]


@pytest.mark.parametrize("variant", ["plain", "compressed", "static"])
def test_cuda_program_launches_copies_syncs(programs: KernelPrograms, tmp_path: Path, variant: str) -> None:
    # Oracle: the program's fixed calls (tests/cuda/kernels.cu), with their arguments and stacks
    prof = _profile(tmp_path, str(getattr(programs, variant)))
    _check_kernels_program(prof)


def test_launch_view_folded(programs: KernelPrograms, tmp_path: Path) -> None:
    # Oracle: the program's fixed calls: scale launched 3 times and add once, from run_steps
    aiflame("profile", "-o", str(tmp_path), "-q", "--formats", "folded", "--group", "none", "--",
            str(programs.plain))
    folded = read_folded(tmp_path / "launches.folded")
    by_kernel = Counter[str]()
    for stack, n in folded.items():
        frames = stack.split(";")
        assert frames[-2] == "-"
        by_kernel[frames[-1]] += n
        assert "main" in frames and "run_steps" in frames
    assert by_kernel == {"scale_[G]": 3, "add_[G]": 1} or by_kernel == {"scale": 3, "add": 1}


def test_registration_names_every_kernel(programs: KernelPrograms, tmp_path: Path) -> None:
    # Oracle: by construction — kernels.cu defines scale, add and demo::fill<int> (Itanium names)
    aiflame("profile", "-o", str(tmp_path), "-q", "--formats", "folded", "--", str(programs.plain))
    cap = read_capture(tmp_path / "profile.aiflame")
    names = {e.strs.get("name") for e in cap.events if e.call == "__cudaRegisterFunction"}
    assert {"_Z5scalePffi", "_Z3addPKfS0_Pfi", "_ZN4demo4fillIiEEvPT_S1_i"} <= names
    fatbins = [e for e in cap.events if e.call == "__cudaRegisterFatBinary"]
    assert len(fatbins) == 1 and fatbins[0].args["fatbin"] != 0


def test_library_loaded_from_python_with_ctypes(programs: KernelPrograms, tmp_path: Path) -> None:
    # Oracle: by construction — Python's run_kernels calls the library through ctypes
    script = tmp_path / "launch.py"
    script.write_text(
        "import ctypes, sys\n"
        "def run_kernels(lib):\n"
        "    return lib.main()\n"
        f"run_kernels(ctypes.CDLL({str(programs.shared_lib)!r}))\n"
    )
    prof = _profile(tmp_path / "out", sys.executable, str(script))
    _check_kernels_program(prof)
    for e in prof.events:
        if e.kind == EventKind.COMPUTE:
            py = [f.name for f in e.stack if f.kind == FrameKind.PYTHON]
            assert "run_kernels" in py, [f.name for f in e.stack]


def test_capture_symbolizes_gpu_offsets_offline(programs: KernelPrograms, tmp_path: Path) -> None:
    """The capture keeps the launched kernels' cubins: an offset resolves from it as from the binary."""
    # Oracle: nvdisasm -g, by way of the binary's line tables that test_cubin checks
    from aiflame.symbolize.accel.gpu_symbols import inventory, lookup_instruction

    aiflame("profile", "-o", str(tmp_path), "-q", "--formats", "folded", "--", str(programs.compressed))
    capture = tmp_path / "profile.aiflame"
    cap = read_capture(capture)
    assert sorted(c.arch for c in cap.gpu_code if c.kind == "cubin") == [80, 90]
    kernels = {k.name for c in inventory(capture).cubins for k in c.kernels}
    assert {"_Z5scalePffi", "_Z3addPKfS0_Pfi"} <= kernels
    for offset in range(0, 0x300, 0x10):
        from_capture = lookup_instruction(capture, "scale", offset, sass=False)
        from_binary = lookup_instruction(programs.compressed, "scale", offset, sass=False)
        assert [(i.arch, i.file, i.line) for i in from_capture] == [(i.arch, i.file, i.line) for i in from_binary]

"""The real-GPU path, on a host with an NVIDIA GPU and driver (skipped elsewhere, saying so): kernels that run
under `aiflame profile`, their launches seen, the cubins the driver loaded captured by CUPTI, and real PC stall
samples that land on those cubins' instructions and under the launching CPU stacks. docs/gpu-testing.md says how
to run this module on a lent GPU machine (`scripts/gpu-tests.sh`).

The workload is bench/gpu/two_kernels.cu (a memory-bound and a compute-bound kernel, launched alternately), built
here for the GPU's own SM with nvcc from NVIDIA's wheels or the CUDA toolkit."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections import Counter
from pathlib import Path

import pytest

from aiflame.agent.runtimes.cuda import RUNTIME_LAUNCHES
from aiflame.core.raw import Capture
from aiflame.symbolize.accel.cubin import cubin_arch
from aiflame.symbolize.road import read
from tests.conftest import REPO
from tests.cuda_build import NVIDIA_DRIVER, nvidia_bin
from tests.integration.conftest import aiflame

pytestmark = pytest.mark.skipif(
    not NVIDIA_DRIVER, reason="no NVIDIA GPU on this host: the real-GPU tests run on a GPU machine "
    "(docs/gpu-testing.md, scripts/gpu-tests.sh)")

TOOLKIT_BIN = Path("/usr/local/cuda/bin")
KERNELS = ("stream_axpy", "fma_chain")


def _toolkit() -> tuple[Path, Path]:
    """nvcc and the libcudart.so.13 it links against: the CUDA toolkit's (a GPU host's), else NVIDIA's wheels."""
    for nvcc, libs in ((TOOLKIT_BIN / "nvcc", TOOLKIT_BIN.parent / "lib64"), (nvidia_bin("nvcc"), None)):
        if nvcc is None or not nvcc.is_file():
            continue
        libs = libs or Path(os.path.realpath(nvcc)).parent.parent / "lib"
        found = sorted(libs.glob("libcudart.so.13*"))
        if found:
            return nvcc, found[0]
    pytest.fail("no nvcc with a shared libcudart.so.13 (/usr/local/cuda or NVIDIA's wheels): a GPU host needs one")


def _device_sm() -> int:
    """The GPU's SM as nvidia-smi reports it (9.0 -> 90): the oracle of the captured cubins' architecture."""
    out = subprocess.run(["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"], capture_output=True,
                         text=True, timeout=60, check=True).stdout.split()[0]
    major, minor = out.split(".")
    return int(major) * 10 + int(minor)


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, float], Capture, list[str], int]:
    """two_kernels built for this GPU and profiled for 2 s: (output dir, its JSON line, the capture read by the
    road, the road's warnings, the device SM)."""
    work = tmp_path_factory.mktemp("gpu")
    nvcc, cudart = _toolkit()
    sm = _device_sm()
    # Linked to the shared cudart (the one the agent probes), through a libcudart.so link: wheels ship .so.13 alone.
    (work / "lib").mkdir()
    (work / "lib" / "libcudart.so").symlink_to(cudart)
    exe = work / "two_kernels"
    subprocess.run([str(nvcc), "-O2", "-lineinfo", "-gencode", f"arch=compute_{sm},code=sm_{sm}", "-cudart", "shared",
                    "-L", str(work / "lib"), "-Xlinker", f"-rpath={cudart.parent}", "-Xcompiler",
                    "-fno-omit-frame-pointer", "-o", str(exe), str(REPO / "bench/gpu/two_kernels.cu")],
                   check=True, timeout=300)
    out = work / "out"
    proc = aiflame("profile", "-o", str(out), "--formats", "folded", "--launch-stacks", "0", "--", str(exe),
                   "--seconds", "2",
                   "--mem-mib", "256", "--fma-iters", "4000")
    assert proc.returncode == 0, proc.stderr
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("{"))
    cap, warnings = read(out / "profile.aiflame")
    return out, json.loads(line), cap, warnings, sm


def test_kernels_run_and_their_launches_are_seen(run: tuple[Path, dict[str, float], Capture, list[str], int]
                                                 ) -> None:
    # Oracle: the program's own count of rounds (each round launches each kernel once)
    _out, report, cap, _warnings, _sm = run
    assert report["rounds"] > 0 and report["stream_axpy_ms"] > 0 and report["fma_chain_ms"] > 0
    counted = Counter(e.call for e in cap.events if e.call in RUNTIME_LAUNCHES)
    # Every launch of the timed rounds is recorded (--launch-stacks 0: each with its stack); warm-up launches may
    # come on top. None is lost.
    assert sum(counted.values()) >= 2 * report["rounds"], counted


def test_cupti_takes_real_samples_on_the_cubins_the_driver_loaded(
        run: tuple[Path, dict[str, float], Capture, list[str], int]) -> None:
    # Oracle: nvidia-smi's compute capability for the cubins' SM; the kernel names of two_kernels.cu
    _out, _report, cap, warnings, sm = run
    assert not [w for w in warnings if "NVIDIA stall sampling" in w], warnings
    assert cap.footer is not None and cap.footer.counters.get("cupti_processes") == 1
    cubins = {c.digest: c for c in cap.gpu_code if c.kind == "cubin" and "(CUPTI)" in c.origin}
    assert cubins and {cubin_arch(c.data) for c in cubins.values()} == {sm}
    total = sum(s.count for s in cap.stalls)
    assert total > 1000, total
    by_kernel: Counter[str] = Counter()
    for s in cap.stalls:
        assert s.code in cubins, s  # every sample's cubin was captured
        by_kernel[next((k for k in KERNELS if k in s.kernel), s.kernel)] += s.count
    # Both kernels run for a sizeable share of the GPU's time: both are sampled, and they are nearly all there is.
    assert by_kernel["stream_axpy"] > 0.05 * total and by_kernel["fma_chain"] > 0.05 * total, by_kernel
    assert by_kernel["stream_axpy"] + by_kernel["fma_chain"] > 0.95 * total, by_kernel


def test_every_sampled_offset_is_an_instruction_nvdisasm_lists(
        run: tuple[Path, dict[str, float], Capture, list[str], int], monkeypatch: pytest.MonkeyPatch) -> None:
    # Oracle: nvdisasm's own listing of each captured cubin (tests/nvdisasm_read.py, not aiflame's parser)
    from tests.nvdisasm_read import nvdisasm_sass

    monkeypatch.setenv("PATH", f"{os.environ.get('PATH', '')}:{TOOLKIT_BIN}")
    if nvidia_bin("nvdisasm") is None and shutil.which("nvdisasm") is None:
        pytest.fail("nvdisasm not found (NVIDIA's wheels or /usr/local/cuda)")
    _out, _report, cap, _warnings, _sm = run
    code = {c.digest: c.data for c in cap.gpu_code}
    listings = {d: nvdisasm_sass(code[d]) for d in {s.code for s in cap.stalls}}
    missing = [(s.kernel, hex(s.offset)) for s in cap.stalls if (s.kernel, s.offset) not in listings[s.code]]
    assert not missing, missing[:10]


def test_the_stall_view_hangs_samples_under_their_launch_stacks(
        run: tuple[Path, dict[str, float], Capture, list[str], int]) -> None:
    # Oracle: two_kernels.cu's call chain (main -> launch_stream/launch_fma -> the runtime's launch)
    from tests.flamegraph_read import read_folded_text

    out, _report, cap, _warnings, _sm = run
    folded = read_folded_text((out / "stalls.folded").read_text())
    total = sum(folded.values())
    assert total == sum(s.count for s in cap.stalls)
    joined = sum(n for stack, n in folded.items()
                 if "main" in stack and any(f.startswith(("launch_stream", "launch_fma")) for f in stack))
    assert joined > 0.9 * total, (joined, total)

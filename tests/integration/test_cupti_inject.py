"""NVIDIA stall sampling end to end on this GPU-less host: the injection library loads into real CUDA programs
(native and Python) started by `aiflame profile`, reports cleanly that no driver initialized it, leaves the
program's behaviour unchanged, and the agent says so in one line. The driver's side of the injection contract
is exercised with the wheel's real libcupti."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from aiflame.agent.accel.cupti import STREAM_PREFIX
from aiflame.agent.accel.cupti_build import CuptiInstall, build_injection
from aiflame.core.capture import read_capture
from aiflame.symbolize.road import read
from aiflame.symbolize.vendor.cupti_stream import parse_stream
from tests.conftest import PROGRAMS
from tests.cuda_build import KERNELS_CU, build_cuda, cuda_root, no_driver_only
from tests.integration.conftest import aiflame


@pytest.fixture(scope="module")
def kernels(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_cuda(KERNELS_CU, tmp_path_factory.mktemp("cupti_cuda") / "kernels", gencodes=(80,))


def test_driver_contract_with_real_cupti(cupti: CuptiInstall, tmp_path: Path) -> None:
    """What cuInit does with CUDA_INJECTION64_PATH, done by a stand-in host: the library loads the wheel's
    libcupti, tries to subscribe, and (no driver here) records why it stopped; the host is undisturbed."""
    lib = build_injection(cupti, cache_dir=tmp_path / "cache")
    host = tmp_path / "host"
    subprocess.run(["cc", "-o", str(host), str(PROGRAMS / "cupti_inject_host.c"), "-ldl"], check=True)
    streams = tmp_path / "streams"
    streams.mkdir()
    env = {**os.environ, "CUDA_INJECTION64_PATH": str(lib), "AIFLAME_CUPTI_DIR": str(streams),
           "AIFLAME_CUPTI_LIB": str(cupti.library), "AIFLAME_CUPTI_PERIOD": "99"}
    proc = subprocess.run([str(host)], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout == "InitializeInjection=1\n" and proc.stderr == ""
    (path,) = streams.iterdir()
    s = parse_stream(path.read_bytes(), path.name)
    assert path.name == f"cupti-{s.pid}.stream" and s.complete and not s.problems
    stages = [e.stage for e in s.errors]
    # A bad option is reported and replaced by the default, never fatal.
    assert stages[0] == "config" and "AIFLAME_CUPTI_PERIOD=99" in s.errors[0].message
    assert s.info["sampling_period_log2"] == "20"
    # No NVIDIA driver on this host: CUPTI cannot subscribe, and the stream says so (a GPU host subscribes).
    assert stages[1:] == ["cuptiSubscribe"] or s.info.get("state") == "subscribed"


def test_missing_cupti_library_is_one_error_record(cupti: CuptiInstall, tmp_path: Path) -> None:
    lib = build_injection(cupti, cache_dir=tmp_path / "cache")
    host = tmp_path / "host"
    subprocess.run(["cc", "-o", str(host), str(PROGRAMS / "cupti_inject_host.c"), "-ldl"], check=True)
    env = {**os.environ, "CUDA_INJECTION64_PATH": str(lib), "AIFLAME_CUPTI_DIR": str(tmp_path),
           "AIFLAME_CUPTI_LIB": str(tmp_path / "nope" / "libcupti.so.13")}
    proc = subprocess.run([str(host)], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0
    (path,) = tmp_path.glob("cupti-*.stream")
    s = parse_stream(path.read_bytes())
    assert s.complete and [e.stage for e in s.errors] == ["dlopen"] and "nope/libcupti.so.13" in s.errors[0].message


def _warnings(stderr: str) -> list[str]:
    return [ln for ln in stderr.splitlines() if ln.startswith("warning:")]


@no_driver_only
def test_cuda_program_under_profile_runs_unchanged_and_reports_no_driver(cupti: CuptiInstall, kernels: Path,
                                                                         tmp_path: Path) -> None:
    plain = subprocess.run([str(kernels)], capture_output=True, text=True, timeout=60)
    # Through a shell that runs another program first: processes that never load CUDA write no stream.
    proc = aiflame("profile", "-o", str(tmp_path), "--formats", "folded", "--", "sh", "-c",
                   f"ls / > /dev/null; {kernels}")
    # The program's own output and exit status are what they are without aiflame.
    assert plain.returncode == 0 and plain.stdout in proc.stdout
    assert "exited with status" not in proc.stdout
    gpu = [w for w in _warnings(proc.stderr) if "NVIDIA stall sampling" in w]
    assert len(gpu) == 1, proc.stderr
    assert "no_driver" in gpu[0] and "libcudart.so.13 was loaded" in gpu[0]
    raw = read_capture(tmp_path / "profile.aiflame")
    assert [s.format for s in raw.streams] == ["cupti"]  # stored as the library wrote it: not sh, not ls
    cap, warnings = read(tmp_path / "profile.aiflame")  # and read on the road, as `profile` did
    assert cap.footer is not None and cap.footer.counters.get("cupti_processes") == 1
    assert cap.stalls == [] and cap.streams == [] and any("no_driver" in w for w in warnings)
    assert not list(tmp_path.glob(STREAM_PREFIX + "*"))  # folded into the capture, then removed


@no_driver_only
def test_python_cuda_target_is_sampled_the_same_way(cupti: CuptiInstall, tmp_path: Path) -> None:
    root = cuda_root()
    assert root is not None
    script = tmp_path / "use_cuda.py"
    script.write_text(
        "import ctypes, sys\n"
        f"rt = ctypes.CDLL({str(root / 'lib' / 'libcudart.so.13')!r})\n"
        "n = ctypes.c_int(-1)\n"
        "print('status', rt.cudaGetDeviceCount(ctypes.byref(n)))\n")
    proc = aiflame("profile", "-o", str(tmp_path), "--formats", "folded", "--", sys.executable, str(script))
    assert "status 35" in proc.stdout  # cudaErrorInsufficientDriver, as without aiflame
    gpu = [w for w in _warnings(proc.stderr) if "NVIDIA stall sampling" in w]
    assert len(gpu) == 1 and "no_driver" in gpu[0], proc.stderr

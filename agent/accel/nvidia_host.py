"""What an NVIDIA GPU host offers aiflame's stall sampling, for `aiflame doctor`: the driver and its CUDA
version, the GPUs, CUPTI, whether the injection library builds (and with which `crt/`), and whether the driver
lets the target's user profile (PC sampling runs inside the target, with the target's credentials).

Read from /proc/driver/nvidia and libcuda's cuDriverGetVersion (which needs no cuInit and touches no GPU).
"""

from __future__ import annotations

import ctypes
import re
from dataclasses import dataclass
from pathlib import Path

from aiflame.agent.accel.cupti_build import CRT_SHIM, build_injection, find_crt, find_cupti
from aiflame.core.errors import HostError

__all__ = ["GpuCheck", "nvidia_checks"]

PROC = Path("/proc/driver/nvidia")


@dataclass(frozen=True)
class GpuCheck:
    name: str
    ok: bool
    detail: str
    fix: str = ""


def _driver(proc: Path) -> GpuCheck:
    try:
        text = (proc / "version").read_text(errors="replace")
    except OSError:
        return GpuCheck("NVIDIA driver", False, f"no {proc}/version: no NVIDIA kernel driver loaded",
                        "only needed on a GPU host")
    m = re.search(r"Kernel Module(?: for x86_64)?\s+([0-9.]+)", text)
    return GpuCheck("NVIDIA driver", True, f"kernel module {m.group(1) if m else text.splitlines()[0][:60]}")


def _cuda_version() -> GpuCheck:
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return GpuCheck("CUDA driver API", False, "libcuda.so.1 not found", "installed with the NVIDIA driver")
    v = ctypes.c_int(0)
    rc = cuda.cuDriverGetVersion(ctypes.byref(v))
    if rc != 0:
        return GpuCheck("CUDA driver API", False, f"cuDriverGetVersion failed ({rc})")
    return GpuCheck("CUDA driver API", True, f"CUDA {v.value // 1000}.{v.value % 1000 // 10} (libcuda.so.1)")


def _gpus(proc: Path) -> GpuCheck:
    models = []
    for info in sorted((proc / "gpus").glob("*/information")):
        try:
            m = re.search(r"^Model:\s*(.+)$", info.read_text(errors="replace"), re.M)
        except OSError:
            continue
        models.append(m.group(1).strip() if m else info.parent.name)
    if not models:
        return GpuCheck("GPUs", False, "none listed in /proc/driver/nvidia/gpus")
    return GpuCheck("GPUs", True, ", ".join(models))


def _permission(proc: Path) -> GpuCheck:
    try:
        params = (proc / "params").read_text(errors="replace")
    except OSError:
        return GpuCheck("PC sampling permitted", False, "no /proc/driver/nvidia/params")
    m = re.search(r"^RmProfilingAdminOnly:\s*(\d+)", params, re.M)
    if m is None or m.group(1) == "0":
        return GpuCheck("PC sampling permitted", True, "for every user (RmProfilingAdminOnly: 0)")
    return GpuCheck("PC sampling permitted", True,
                    "for root only (RmProfilingAdminOnly: 1): targets that run as another user are not sampled",
                    "modprobe nvidia NVreg_RestrictProfilingToAdminUsers=0 to sample other users' programs")


def _collector() -> list[GpuCheck]:
    install = find_cupti()
    if install is None:
        return [GpuCheck("CUPTI", False, "nvidia-cuda-cupti is not installed beside aiflame",
                         "pip install nvidia-cuda-cupti (PyTorch's CUDA wheels bring it)")]
    version = ""
    try:
        m = re.search(r"#define\s+CUPTI_API_VERSION\s+(\d+)", (install.include / "cupti_version.h").read_text())
        version = f" (API {m.group(1)})" if m else ""
    except OSError:
        pass
    out = [GpuCheck("CUPTI", True, f"{install.library}{version}")]
    crt = find_crt(install)
    headers = f"CUDA's crt/ from {crt}" if crt is not None else f"aiflame's crt/ stand-in ({CRT_SHIM})"
    try:
        lib = build_injection(install)
    except HostError as e:
        out.append(GpuCheck("stall collector builds", False, str(e)))
    else:
        out.append(GpuCheck("stall collector builds", True, f"{lib} (with {headers})"))
    return out


def nvidia_checks(proc: Path = PROC) -> list[GpuCheck]:
    """Every check, GPU or not (on a host without NVIDIA's driver the first says so and the collector's still
    run: captures can be imported and symbolized anywhere)."""
    driver = _driver(proc)
    checks = [driver]
    if driver.ok:
        checks += [_cuda_version(), _gpus(proc), _permission(proc)]
    return checks + _collector()

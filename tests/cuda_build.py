"""Build CUDA test programs with NVIDIA's compiler from PyPI (`nvidia-cuda-nvcc`, the accel-test extra).

No GPU is needed: the programs run, and every CUDA call returns cudaErrorInsufficientDriver (35). nvcc is part
of `make setup`, so a missing compiler fails the tests that need it rather than skipping them.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import pytest

__all__ = ["CUDA_DIR", "CUDA_RET", "KERNELS_CU", "NVIDIA_DRIVER", "KernelPrograms", "build_cuda", "cuda_root",
           "kernel_programs", "nvidia_bin", "no_driver_only"]

CUDA_DIR = Path(__file__).resolve().parent / "cuda"
KERNELS_CU = CUDA_DIR / "kernels.cu"

# On a GPU host (an NVIDIA driver loaded) the same programs run for real: CUDA calls return cudaSuccess, not
# cudaErrorInsufficientDriver, and the no-driver paths cannot be reached.
NVIDIA_DRIVER = Path("/proc/driver/nvidia/version").exists()
CUDA_RET = 0 if NVIDIA_DRIVER else 35
no_driver_only = pytest.mark.skipif(NVIDIA_DRIVER, reason="this host has an NVIDIA driver: the no-driver path "
                                    "cannot be reached here (bench/gpu/check.sh covers the GPU path)")

_built: dict[tuple[object, ...], Path] = {}
_programs: dict[str, KernelPrograms] = {}
_lock = threading.Lock()


def cuda_root() -> Path | None:
    """The `nvidia/cu13` directory of the installed NVIDIA wheels (bin/, lib/, include/), if any."""
    roots = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"], *sys.path}
    for root in sorted(r for r in roots if r):
        p = Path(root) / "nvidia" / "cu13"
        if (p / "bin").is_dir():
            return p
    return None


def nvidia_bin(name: str) -> Path | None:
    """An NVIDIA tool (nvcc, nvdisasm, cuobjdump, ...) from the wheels, else from PATH; None when absent."""
    root = cuda_root()
    if root is not None and (root / "bin" / name).is_file():
        return root / "bin" / name
    hit = shutil.which(name)
    return Path(hit) if hit else None


def _libdir(root: Path, work: Path) -> Path:
    """A directory with the `libcudart.so` link that `-cudart shared` needs (the wheel ships only .so.13)."""
    d = work / ".cudalib"
    d.mkdir(parents=True, exist_ok=True)
    link = d / "libcudart.so"
    if not link.exists():
        try:
            link.symlink_to(root / "lib" / "libcudart.so.13")
        except FileExistsError:
            pass  # another build thread made it
    return d


def build_cuda(
    src_path: str | os.PathLike[str],
    out_path: str | os.PathLike[str],
    *,
    gencodes: Sequence[int] = (80, 90),
    cudart: str = "shared",
    compress: bool = False,
    shared_lib: bool = False,
    extra: Sequence[str] = (),
) -> Path:
    """Compile `src_path` into `out_path` with `-g -lineinfo`, SASS for each of `gencodes` and frame pointers.

    `cudart` is "shared" (rpath to the wheel's libcudart.so.13) or "static"; `compress` adds
    `-Xfatbin -compress-all` (cubins compressed too, not only PTX); `shared_lib` builds a `-shared -fPIC`
    library; `extra` goes to nvcc last (e.g. "-gencode", "arch=compute_90,code=compute_90" to embed PTX). Each
    distinct build runs once per test session. Fails the test when nvcc is missing or the build fails.
    """
    out = Path(out_path)
    key = (Path(src_path).resolve(), out.resolve(), tuple(gencodes), cudart, compress, shared_lib, tuple(extra))
    with _lock:
        hit = _built.get(key)
    if hit is not None and hit.exists():
        return hit
    root = cuda_root()
    nvcc = nvidia_bin("nvcc")
    if nvcc is None or root is None:
        pytest.fail("nvcc not found: install the accel-test extra (`make setup`)")
    out.parent.mkdir(parents=True, exist_ok=True)
    cmd = [str(nvcc), "-g", "-lineinfo", "-cudart", cudart]
    for sm in gencodes:
        cmd += ["-gencode", f"arch=compute_{sm},code=sm_{sm}"]
    if cudart == "shared":
        cmd += ["-L", str(_libdir(root, out.parent)), "-Xlinker", f"-rpath={root / 'lib'}"]
    if compress:
        cmd += ["-Xfatbin", "-compress-all"]
    if shared_lib:
        cmd += ["-shared", "-Xcompiler", "-fPIC"]
    cmd += ["-Xcompiler", "-fno-omit-frame-pointer", *extra, "-o", str(out), str(src_path)]
    env = {**os.environ, "PATH": f"{nvcc.parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        pytest.fail(f"nvcc failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stderr[-4000:]}")
    with _lock:
        _built[key] = out
    return out


@dataclass(frozen=True)
class KernelPrograms:
    """tests/cuda/kernels.cu built the ways the GPU-symbol tests need, each once per session."""

    dir: Path
    plain: Path  # shared cudart; SASS for sm_80 and sm_90, PTX for compute_90
    compressed: Path  # -Xfatbin -compress-all: zstd cubins and PTX
    static: Path  # -cudart static
    shared_lib: Path  # libkernels.so
    debug: Path  # -G (device debug): long, branchy line tables

    def all(self) -> list[Path]:
        return [self.plain, self.compressed, self.static, self.shared_lib, self.debug]


_PTX90 = ("-gencode", "arch=compute_90,code=compute_90")


def kernel_programs(tmp_path_factory: pytest.TempPathFactory) -> KernelPrograms:
    """Build (in parallel, once per session) and return the kernels.cu variants."""
    with _lock:
        hit = _programs.get("kernels")
    if hit is not None:
        return hit
    d = tmp_path_factory.mktemp("cuda")
    src = KERNELS_CU
    jobs: dict[str, partial[Path]] = {
        "plain": partial(build_cuda, src, d / "kernels", extra=_PTX90),
        "compressed": partial(build_cuda, src, d / "kernels_z", compress=True, extra=_PTX90),
        "static": partial(build_cuda, src, d / "kernels_static", cudart="static"),
        "shared_lib": partial(build_cuda, src, d / "libkernels.so", shared_lib=True),
        "debug": partial(build_cuda, src, d / "kernels_G", extra=("-G",)),
    }
    with ThreadPoolExecutor(max_workers=max(2, min(len(jobs), os.cpu_count() or 2))) as pool:
        futures = {name: pool.submit(job) for name, job in jobs.items()}
        paths = {name: f.result() for name, f in futures.items()}
    progs = KernelPrograms(d, **paths)
    with _lock:
        _programs["kernels"] = progs
    return progs

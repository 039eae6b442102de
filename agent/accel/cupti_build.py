"""Find NVIDIA's CUPTI (the optional `nvidia-cuda-cupti` wheel) and build aiflame's injection library against it.

Nothing NVIDIA-licensed is shipped with aiflame: the library's C source (`cupti_inject.c`) is ours, and it is
compiled on first use with the host's C compiler against the headers of the wheel installed next to aiflame,
into a cache directory keyed by the source, the headers and the compiler. It loads `libcupti.so` at run time
from the path the agent passes.

CUPTI's headers include CUDA's runtime types, which include `crt/host_defines.h`. A pip install of PyTorch brings
CUPTI's and the runtime's headers but not `crt/` (that is `nvidia-cuda-crt`), so `crt/` is looked for where a GPU
host keeps it (`find_crt`); where there is none, `cuda_shim/crt/host_defines.h` (ours: the dozen empty
host-side macros those headers use) stands in, which compiles the library to the same code.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
import subprocess
import sys
import sysconfig
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from aiflame.core.errors import HostError, Refused
from aiflame.core.safe_files import trusted_dir

__all__ = ["CRT_SHIM", "CuptiInstall", "INJECT_SOURCE", "build_injection", "crt_candidates", "find_crt", "find_cupti",
           "library_cache_dir"]

INJECT_SOURCE = Path(__file__).resolve().parent / "cupti_inject.c"
CRT_SHIM = Path(__file__).resolve().parent / "cuda_shim"  # holds crt/host_defines.h
LIB_NAME = "libaiflame_cupti.so"
HOST_DEFINES = Path("crt") / "host_defines.h"


@dataclass(frozen=True)
class CuptiInstall:
    """Where the CUPTI wheel put its headers and library."""

    include: Path  # holds cupti.h, cupti_pcsampling.h, cuda.h
    library: Path  # libcupti.so.N


def _site_dirs() -> list[Path]:
    paths = sysconfig.get_paths()
    roots = {paths["purelib"], paths["platlib"], *sys.path}
    return [Path(r) for r in sorted(r for r in roots if r)]


def find_cupti() -> CuptiInstall | None:
    """The installed `nvidia-cuda-cupti` wheel (CUDA 13, then 12 layout), or None."""
    for root in _site_dirs():
        for sub in ("nvidia/cu13", "nvidia/cuda_cupti"):
            d = root / sub
            inc = d / "include"
            if not (inc / "cupti_pcsampling.h").is_file() or not (inc / "cuda.h").is_file():
                continue
            libs = sorted((d / "lib").glob("libcupti.so*"), key=lambda p: len(p.name), reverse=True)
            if libs:
                return CuptiInstall(inc, libs[0])
    return None


def _toolkit_includes(root: Path) -> list[Path]:
    """A CUDA toolkit's include directories: `include` and `targets/<arch>/include`."""
    out = [root / "include"]
    try:
        out += sorted((root / "targets").glob("*/include"))
    except OSError:
        pass
    return out


def crt_candidates(cupti: CuptiInstall, env: Mapping[str, str] | None = None) -> list[Path]:
    """Include directories that may hold `crt/host_defines.h`, best first: CUPTI's own, the NVIDIA wheels beside
    it, $CUDA_HOME/$CUDA_PATH/$CUDA_ROOT, the toolkit of the `nvcc` on PATH, /usr/local/cuda*, /opt/cuda."""
    env = os.environ if env is None else env
    out = [cupti.include]
    nvidia = cupti.include.parent.parent  # site-packages/nvidia/<pkg>/include -> site-packages/nvidia
    for sub in ("cu13", "cu12", "cuda_crt", "cuda_nvcc", "cuda_runtime"):
        out.append(nvidia / sub / "include")
    for var in ("CUDA_HOME", "CUDA_PATH", "CUDA_ROOT"):
        if env.get(var):
            out += _toolkit_includes(Path(env[var]))
    nvcc = shutil.which("nvcc", path=env.get("PATH"))
    if nvcc:
        out += _toolkit_includes(Path(os.path.realpath(nvcc)).parent.parent)
    out += _toolkit_includes(Path("/usr/local/cuda"))
    out += [p for d in sorted(Path("/usr/local").glob("cuda-*"), reverse=True) for p in _toolkit_includes(d)]
    out += _toolkit_includes(Path("/opt/cuda"))
    return list(dict.fromkeys(out))


def find_crt(cupti: CuptiInstall, env: Mapping[str, str] | None = None) -> Path | None:
    """The first candidate include directory that has `crt/host_defines.h`, or None (then the shim serves)."""
    for d in crt_candidates(cupti, env):
        if (d / HOST_DEFINES).is_file():
            return d
    return None


def library_cache_dir() -> Path:
    """$AIFLAME_CUPTI_CACHE, else ~/.cache/aiflame/cupti (next to the symbol cache)."""
    env = os.environ.get("AIFLAME_CUPTI_CACHE")
    if env:
        return Path(env)
    return Path(os.path.expanduser("~")) / ".cache" / "aiflame" / "cupti"


def _compiler() -> str:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise HostError("no C compiler (cc/gcc) to build the CUPTI injection library: install gcc")
    return cc


def _build_key(cc: str, cupti: CuptiInstall, crt: Path) -> str:
    h = hashlib.sha256(INJECT_SOURCE.read_bytes())
    for p in (*(cupti.include / n for n in ("cupti_pcsampling.h", "cupti_callbacks.h", "cupti_version.h")),
              crt / HOST_DEFINES):
        if p.is_file():
            h.update(p.read_bytes())
    h.update(cc.encode())
    return h.hexdigest()[:24]


def build_injection(cupti: CuptiInstall, cache_dir: Path | None = None, env: Mapping[str, str] | None = None
                    ) -> Path:
    """The injection library for `cupti`, compiled once into the cache (atomic rename, so concurrent agents
    are safe). Raises HostError with the compiler's first error line when the build fails."""
    cc = _compiler()
    crt = find_crt(cupti, env)
    tries = [crt, CRT_SHIM] if crt is not None else [CRT_SHIM]
    first_error = ""
    for inc in tries:
        try:
            return _build(cc, cupti, inc, cache_dir)
        except _CompileFailed as e:
            first_error = first_error or str(e)
    looked = "" if crt is not None else " (CUDA's crt/host_defines.h was not found beside CUPTI, in $CUDA_HOME, " \
        "beside nvcc or in /usr/local/cuda*, and aiflame's stand-in did not do)"
    raise HostError(f"building the CUPTI injection library failed: {first_error}{looked}; "
                    "`pip install nvidia-cuda-crt` or set CUDA_HOME to a CUDA toolkit")


class _CompileFailed(Exception):
    """The compiler rejected the source with these headers (the message: its first error line)."""


def _build(cc: str, cupti: CuptiInstall, crt: Path, cache_dir: Path | None) -> Path:
    out_dir = (cache_dir or library_cache_dir()) / _build_key(cc, cupti, crt)
    lib = out_dir / LIB_NAME
    # Every target of the capture loads this library (as root, often): only a directory that nobody but us and
    # root can change, all the way up, may hold it (a home directory sudo kept must not; core/safe_files.py).
    try:
        os.close(trusted_dir(out_dir.absolute(), mode=0o700))
    except Refused as e:
        raise HostError(f"cannot keep the CUPTI injection library there: {e} (set AIFLAME_CUPTI_CACHE)") from None
    except OSError as e:
        raise HostError(f"cannot create {out_dir}: {e.strerror}") from None
    try:
        st = os.lstat(lib)
    except FileNotFoundError:
        pass
    else:
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
            raise HostError(f"{lib}: not a regular file only we can write to")
        return lib
    fd, tmp = tempfile.mkstemp(prefix=".build-", suffix=".so", dir=out_dir)
    os.close(fd)
    # CUPTI's directory first, so its own headers win over a toolkit's of another version that only lends crt/.
    cmd = [cc, "-O2", "-g", "-Wall", "-shared", "-fPIC", "-fvisibility=hidden", "-I", str(cupti.include),
           "-I", str(crt), "-o", tmp, str(INJECT_SOURCE), "-ldl", "-lpthread"]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as e:
        os.unlink(tmp)
        raise HostError(f"cannot run {cc}: {e}") from None
    if proc.returncode != 0:
        os.unlink(tmp)
        raise _CompileFailed(next((ln for ln in proc.stderr.splitlines() if "error" in ln),
                                  proc.stderr.strip()[:200]))
    os.replace(tmp, lib)
    return lib

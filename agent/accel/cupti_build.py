"""Find NVIDIA's CUPTI (the optional `nvidia-cuda-cupti` wheel) and build aiflame's injection library against it.

Nothing NVIDIA-licensed is shipped with aiflame: the library's C source (`cupti_inject.c`) is ours, and it is
compiled on first use with the host's C compiler against the headers of the wheel installed next to aiflame,
into a cache directory keyed by the source, the headers' version and the compiler. It loads `libcupti.so` at
run time from the path the agent passes.
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
from dataclasses import dataclass
from pathlib import Path

from aiflame.core.errors import HostError
from aiflame.core.safe_files import FileRefused, trusted_dir

__all__ = ["CuptiBuildError", "CuptiInstall", "INJECT_SOURCE", "build_injection", "find_cupti", "library_cache_dir"]

INJECT_SOURCE = Path(__file__).resolve().parent / "cupti_inject.c"
LIB_NAME = "libaiflame_cupti.so"


class CuptiBuildError(HostError):
    """CUPTI is missing or the injection library cannot be built; the message is one user-facing line."""


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


def library_cache_dir() -> Path:
    """$AIFLAME_CUPTI_CACHE, else ~/.cache/aiflame/cupti (next to the symbol cache)."""
    env = os.environ.get("AIFLAME_CUPTI_CACHE")
    if env:
        return Path(env)
    return Path(os.path.expanduser("~")) / ".cache" / "aiflame" / "cupti"


def _compiler() -> str:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise CuptiBuildError("no C compiler (cc/gcc) to build the CUPTI injection library: install gcc")
    return cc


def _build_key(cc: str, cupti: CuptiInstall) -> str:
    h = hashlib.sha256(INJECT_SOURCE.read_bytes())
    for header in ("cupti_pcsampling.h", "cupti_callbacks.h", "cupti_version.h"):
        p = cupti.include / header
        if p.is_file():
            h.update(p.read_bytes())
    h.update(cc.encode())
    return h.hexdigest()[:24]


def build_injection(cupti: CuptiInstall, cache_dir: Path | None = None) -> Path:
    """The injection library for `cupti`, compiled once into the cache (atomic rename, so concurrent agents
    are safe). Raises CuptiBuildError with the compiler's first error line when the build fails."""
    cc = _compiler()
    out_dir = (cache_dir or library_cache_dir()) / _build_key(cc, cupti)
    lib = out_dir / LIB_NAME
    # Every target of the capture loads this library (as root, often): only a directory that nobody but us and
    # root can change, all the way up, may hold it (a home directory sudo kept must not; core/safe_files.py).
    try:
        os.close(trusted_dir(out_dir.absolute(), mode=0o700))
    except FileRefused as e:
        raise CuptiBuildError(f"cannot keep the CUPTI injection library there: {e} (set AIFLAME_CUPTI_CACHE)") from None
    except OSError as e:
        raise CuptiBuildError(f"cannot create {out_dir}: {e.strerror}") from None
    try:
        st = os.lstat(lib)
    except FileNotFoundError:
        pass
    else:
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
            raise CuptiBuildError(f"{lib}: not a regular file only we can write to")
        return lib
    fd, tmp = tempfile.mkstemp(prefix=".build-", suffix=".so", dir=out_dir)
    os.close(fd)
    cmd = [cc, "-O2", "-g", "-Wall", "-shared", "-fPIC", "-fvisibility=hidden", "-I", str(cupti.include),
           "-o", tmp, str(INJECT_SOURCE), "-ldl", "-lpthread"]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as e:
        os.unlink(tmp)
        raise CuptiBuildError(f"cannot run {cc}: {e}") from None
    if proc.returncode != 0:
        os.unlink(tmp)
        first = next((ln for ln in proc.stderr.splitlines() if "error" in ln), proc.stderr.strip()[:200])
        raise CuptiBuildError(f"building the CUPTI injection library failed: {first}")
    os.replace(tmp, lib)
    return lib

"""The CUPTI injection library builds where PyTorch is installed from pip: CUPTI's and the runtime's headers are
there, CUDA's `crt/` is not (it is `nvidia-cuda-crt`, which torch does not pull in). The build looks for `crt/`
where GPU hosts keep it and otherwise uses aiflame's stand-in, which must compile to the same machine code."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from aiflame.agent.accel import cupti_build
from aiflame.agent.accel.cupti_build import (
    CRT_SHIM,
    INJECT_SOURCE,
    CuptiInstall,
    build_injection,
    crt_candidates,
    find_crt,
)
from aiflame.core.errors import HostError


def _pip_torch_layout(cupti: CuptiInstall, root: Path) -> CuptiInstall:
    """site-packages/nvidia/cu13 as `pip install torch` leaves it: the wheel's headers without crt/."""
    inc = root / "site-packages" / "nvidia" / "cu13" / "include"
    shutil.copytree(cupti.include, inc, ignore=shutil.ignore_patterns("crt"))
    assert not (inc / "crt").exists() and (inc / "device_types.h").is_file()
    return CuptiInstall(inc, cupti.library)


def _text(obj: Path) -> str:
    """The object's disassembly without its file name line."""
    out = subprocess.run(["objdump", "-d", str(obj)], capture_output=True, text=True, check=True).stdout
    return out.split("\n", 2)[2]


def test_pip_torch_layout_fails_to_compile_without_help(cupti: CuptiInstall, tmp_path: Path) -> None:
    """The H200's failure, reproduced: the wheel's headers alone do not compile."""
    bare = _pip_torch_layout(cupti, tmp_path)
    proc = subprocess.run(["cc", "-fsyntax-only", "-I", str(bare.include), str(INJECT_SOURCE)],
                          capture_output=True, text=True)
    assert proc.returncode != 0 and "crt/host_defines.h" in proc.stderr


def test_builds_with_the_stand_in_when_no_crt_exists(cupti: CuptiInstall, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    bare = _pip_torch_layout(cupti, tmp_path)
    monkeypatch.setattr(cupti_build, "crt_candidates", lambda c, env=None: [c.include])
    assert find_crt(bare) is None
    lib = build_injection(bare, cache_dir=tmp_path / "cache")
    syms = subprocess.run(["nm", "-D", "--defined-only", str(lib)], capture_output=True, text=True,
                          check=True).stdout
    assert "InitializeInjection" in syms and "aiflame_cupti_write_pcs" in syms


def test_stand_in_compiles_to_the_same_code_as_cudas_crt(cupti: CuptiInstall, tmp_path: Path) -> None:
    """Our crt/host_defines.h only has to make CUDA's host-side headers parse as C; the library built with it
    must be the library built with NVIDIA's (same instructions, byte for byte)."""
    real = find_crt(cupti)
    assert real is not None, "make setup installs nvidia-cuda-nvcc, whose headers have crt/"
    bare = _pip_torch_layout(cupti, tmp_path)
    objs = []
    for name, crt in (("real", real), ("shim", CRT_SHIM)):
        o = tmp_path / f"{name}.o"
        subprocess.run(["cc", "-O2", "-fPIC", "-c", "-I", str(bare.include), "-I", str(crt), "-o", str(o),
                        str(INJECT_SOURCE)], check=True, capture_output=True, text=True)
        objs.append(_text(o))
    assert objs[0] == objs[1]


def test_crt_is_found_in_cuda_home_and_targets(cupti: CuptiInstall, tmp_path: Path) -> None:
    """A toolkit named by CUDA_HOME, with crt/ under targets/<arch>/include as NVIDIA's packages lay it out."""
    bare = _pip_torch_layout(cupti, tmp_path / "py")
    toolkit = tmp_path / "cuda-13.0"
    inc = toolkit / "targets" / "x86_64-linux" / "include"
    (inc / "crt").mkdir(parents=True)
    shutil.copy(CRT_SHIM / "crt" / "host_defines.h", inc / "crt" / "host_defines.h")
    env = {"CUDA_HOME": str(toolkit), "PATH": ""}
    cands = crt_candidates(bare, env)
    assert cands[0] == bare.include and inc in cands
    assert cands.index(inc) < cands.index(Path("/usr/local/cuda/include"))
    assert find_crt(bare, env) == inc
    assert build_injection(bare, cache_dir=tmp_path / "cache", env=env).is_file()


def test_nvcc_on_path_lends_its_toolkit(cupti: CuptiInstall, tmp_path: Path) -> None:
    toolkit = tmp_path / "tk"
    (toolkit / "bin").mkdir(parents=True)
    nvcc = toolkit / "bin" / "nvcc"
    nvcc.write_text("#!/bin/sh\n")
    nvcc.chmod(0o755)
    assert toolkit / "include" in crt_candidates(cupti, {"PATH": str(toolkit / "bin")})


def test_unbuildable_headers_say_what_is_missing_in_one_line(cupti: CuptiInstall, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Headers the stand-in cannot rescue (here: no cupti_pcsampling.h): one line that names the file and
    what to install."""
    bare = _pip_torch_layout(cupti, tmp_path)
    (bare.include / "cupti_pcsampling.h").unlink()
    monkeypatch.setattr(cupti_build, "crt_candidates", lambda c, env=None: [c.include])
    with pytest.raises(HostError) as e:
        build_injection(bare, cache_dir=tmp_path / "cache")
    msg = str(e.value)
    assert "\n" not in msg and "cupti_pcsampling.h" in msg and "nvidia-cuda-crt" in msg

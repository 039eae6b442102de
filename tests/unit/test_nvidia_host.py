"""`aiflame doctor`'s GPU section, read from a /proc/driver/nvidia laid out as driver 580 lays it out."""

from __future__ import annotations

from pathlib import Path

import pytest

from aiflame.agent.accel.nvidia_host import nvidia_checks
from aiflame.cli.main import main


def _proc(root: Path, admin_only: int) -> Path:
    (root / "gpus" / "0000:00:05.0").mkdir(parents=True)
    (root / "version").write_text(
        "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.159.04  Release Build  (dvs-builder@U22)\n"
        "GCC version:  gcc version 12.3.0\n")
    (root / "params").write_text(f"ResmanDebugLevel: 4294967295\nRmProfilingAdminOnly: {admin_only}\n")
    (root / "gpus" / "0000:00:05.0" / "information").write_text(
        "Model: \t\t NVIDIA H200\nIRQ:   \t\t 0\nGPU UUID: \t GPU-x\n")
    return root


def test_gpu_host_checks(tmp_path: Path) -> None:
    by = {c.name: c for c in nvidia_checks(_proc(tmp_path, 1))}
    assert by["NVIDIA driver"].ok and "580.159.04" in by["NVIDIA driver"].detail
    assert by["GPUs"].detail == "NVIDIA H200"
    perm = by["PC sampling permitted"]
    assert "root only" in perm.detail and "NVreg_RestrictProfilingToAdminUsers=0" in perm.fix
    assert by["CUPTI"].ok and "libcupti.so" in by["CUPTI"].detail
    assert by["stall collector builds"].ok and "libaiflame_cupti.so" in by["stall collector builds"].detail


def test_no_driver_says_so_and_still_checks_the_collector(tmp_path: Path) -> None:
    checks = nvidia_checks(tmp_path / "absent")
    assert [c.name for c in checks] == ["NVIDIA driver", "CUPTI", "stall collector builds"]
    assert not checks[0].ok and "no NVIDIA kernel driver" in checks[0].detail


def test_doctor_prints_the_gpu_section(capsys: pytest.CaptureFixture[str]) -> None:
    main(["doctor"])
    out = capsys.readouterr().out
    assert "NVIDIA GPU stall sampling" in out and "CUPTI" in out and "collector" in out

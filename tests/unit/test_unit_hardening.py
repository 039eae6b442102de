"""The doctor's view of the daemon unit: parsing unit files as systemd reads them, naming capability masks."""

from __future__ import annotations

import pytest

from aiflame.cli import unit_hardening
from aiflame.cli.main import main
from aiflame.cli.unit_hardening import HARDENING, SHIPPED, Daemon, capability_names, unit_settings


def test_unit_settings_as_systemd_reads_them() -> None:
    text = "[Service]\n# a comment\nMemoryMax=1G\nMemoryMax=512M\nDeviceAllow=char-drm rw\nDeviceAllow=/dev/null r\n"
    assert unit_settings(text) == {"MemoryMax": "512M", "DeviceAllow": "char-drm rw, /dev/null r"}


def test_the_shipped_unit_sets_every_hardening_setting_it_means_to() -> None:
    shipped = unit_settings(SHIPPED.read_text())
    unset = {k for k in HARDENING if k not in shipped}
    assert unset == {"PrivateTmp"}  # on purpose: docs/daemon.md says why
    assert "CAP_DAC_OVERRIDE" not in shipped["CapabilityBoundingSet"]
    assert shipped["DevicePolicy"] == "closed" and shipped["KillMode"] == "mixed"


def test_capability_names() -> None:
    assert capability_names((1 << 21) | (1 << 39)) == ["CAP_SYS_ADMIN", "CAP_BPF"]
    assert capability_names(1 << 63) == ["cap_63"]


def _doctor(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], installed: str,
            daemons: list[Daemon], *argv: str) -> str:
    rows = [(key, "x", installed) for key in HARDENING]
    monkeypatch.setattr(unit_hardening, "unit_table", lambda: (rows, daemons))
    main(["doctor", *argv])
    return capsys.readouterr().out


def test_doctor_shows_the_hardening_table_only_where_it_matters(monkeypatch: pytest.MonkeyPatch,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    out = _doctor(monkeypatch, capsys, "(not installed)", [])
    assert "daemon unit hardening" not in out and "KillMode" not in out
    assert "daemon: unit not installed, no daemon running (--verbose shows the unit's hardening)" in \
        " ".join(out.split())
    assert "aiflame doctor" in out and "NVIDIA GPU stall sampling" in out  # the rest is kept
    for argv, installed, daemons in ((["--verbose"], "(not installed)", []), ([], "mixed", []),
                                     ([], "(not installed)", [Daemon(7, [], True, 0, "none")])):
        out = _doctor(monkeypatch, capsys, installed, daemons, *argv)
        assert "daemon unit hardening" in out and "KillMode" in out, (argv, installed)

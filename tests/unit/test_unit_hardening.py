"""The doctor's view of the daemon unit: parsing unit files as systemd reads them, naming capability masks."""

from __future__ import annotations

from aiflame.cli.unit_hardening import HARDENING, SHIPPED, capability_names, unit_settings


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

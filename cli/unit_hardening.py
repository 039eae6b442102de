"""What `aiflame doctor` says about the daemon's sandbox: the hardening settings of the unit this checkout ships
(deploy/aiflame-agent.service), of the unit installed (if any), and what a running daemon really has (its
capability bounding set, no-new-privileges, controlling terminal, memory limit), so a host whose unit was edited or
whose daemon runs outside systemd shows it."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

__all__ = ["HARDENING", "Daemon", "capability_names", "running_daemons", "unit_settings", "unit_table"]

UNIT_NAME = "aiflame-agent.service"
SHIPPED = Path(__file__).resolve().parents[1] / "deploy" / UNIT_NAME
INSTALLED = Path("/etc/systemd/system") / UNIT_NAME
# The settings that make up its hardening, in the order shown.
HARDENING = ("CapabilityBoundingSet", "AmbientCapabilities", "NoNewPrivileges", "ProtectSystem", "ProtectHome",
             "ProtectKernelTunables", "DevicePolicy", "DeviceAllow", "PrivateNetwork", "RestrictAddressFamilies",
             "RestrictNamespaces", "RestrictSUIDSGID", "PrivateTmp", "UMask", "MemoryMax", "KillMode", "LimitCORE")

# capability(7) numbers, as /proc/PID/status CapBnd has them
_CAPS = ("chown dac_override dac_read_search fowner fsetid kill setgid setuid setpcap linux_immutable "
         "net_bind_service net_broadcast net_admin net_raw ipc_lock ipc_owner sys_module sys_rawio sys_chroot "
         "sys_ptrace sys_pacct sys_admin sys_boot sys_nice sys_resource sys_time sys_tty_config mknod lease "
         "audit_write audit_control setfcap mac_override mac_admin syslog wake_alarm block_suspend audit_read "
         "perfmon bpf checkpoint_restore").split()


def unit_settings(text: str) -> dict[str, str]:
    """The [Service] (and other) settings of a unit file: the last assignment of a key wins, as in systemd, except
    that repeated DeviceAllow= lines add up."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";", "[")) or "=" not in line:
            continue
        key, _, value = line.partition("=")
        key, value = key.strip(), value.strip()
        out[key] = f"{out[key]}, {value}" if key == "DeviceAllow" and key in out and value else value
    return out


def capability_names(mask: int) -> list[str]:
    return [f"CAP_{name.upper()}" for i, name in enumerate(_CAPS) if mask >> i & 1] + \
        [f"cap_{i}" for i in range(len(_CAPS), 64) if mask >> i & 1]


@dataclass
class Daemon:
    """A running `aiflame agent` as /proc shows it."""

    pid: int
    capabilities: list[str]
    no_new_privs: bool
    tty: int
    memory_limit: str


def running_daemons() -> list[Daemon]:
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            argv = Path(f"/proc/{name}/cmdline").read_bytes().split(b"\0")
            if not any(a.endswith(b"aiflame") or a == b"aiflame" for a in argv[:3]) or b"agent" not in argv[1:4]:
                continue
            if b"--check" in argv:
                continue
            status = dict(line.split(":", 1) for line in Path(f"/proc/{name}/status").read_text().splitlines()
                          if ":" in line)
            tty = int(Path(f"/proc/{name}/stat").read_text().rsplit(")", 1)[1].split()[4])
            out.append(Daemon(int(name), capability_names(int(status["CapBnd"].strip(), 16)),
                              status.get("NoNewPrivs", "0").strip() == "1", tty, _memory_limit(int(name))))
        except (OSError, ValueError, KeyError, IndexError):
            continue
    return out


def _memory_limit(pid: int) -> str:
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        for f in ([Path("/sys/fs/cgroup") / path.lstrip("/") / "memory.max"] if controllers == "" else
                  [Path("/sys/fs/cgroup/memory") / path.lstrip("/") / "memory.limit_in_bytes"]
                  if "memory" in controllers.split(",") else []):
            try:
                value = f.read_text().strip()
            except OSError:
                continue
            if value not in ("max", "9223372036854771712"):
                return f"{int(value) >> 20} MiB"
    return "none"


def unit_table() -> tuple[list[tuple[str, str, str]], list[Daemon]]:
    """(setting, shipped, installed) for each hardening setting, and the daemons running now. `installed` is
    "(not installed)" where the unit is not in /etc/systemd/system."""
    shipped = unit_settings(SHIPPED.read_text()) if SHIPPED.exists() else {}
    try:
        installed: dict[str, str] | None = unit_settings(INSTALLED.read_text())
    except OSError:
        installed = None
    rows = [(key, shipped.get(key, "(unset)"),
             "(not installed)" if installed is None else installed.get(key, "(unset)")) for key in HARDENING]
    return rows, running_daemons()

"""The checks a capture makes before it starts, each failing with one user-facing line: root, the host's PID
namespace, tracefs, a live target, a writable output directory."""

from __future__ import annotations

import os
from pathlib import Path

from aiflame.agent.kernel.bpf_sys import TRACEFS
from aiflame.agent.procs import GONE, status
from aiflame.core.errors import BadInput, HostError, TargetGone

INIT_PID_NS = "pid:[4026531836]"  # the kernel's fixed inode of the initial PID namespace (PROC_PID_INIT_INO)


def check_root() -> None:
    """Root, and a /proc that numbers processes as BPF does (the host's PID namespace)."""
    if os.geteuid() != 0:
        raise HostError("must run as root (BPF and perf events need it); try sudo")
    try:
        ns = os.readlink("/proc/1/ns/pid")  # pid 1 of the namespace this /proc shows (psutil has no namespaces)
    except OSError:
        return
    if ns != INIT_PID_NS:
        raise HostError("runs in a PID namespace other than the host's: BPF reports host pids, which this /proc "
                        "does not show; run it in the host's (docker run --pid=host, Kubernetes hostPID: true)")


def _ns(kind: str, pid: str) -> str:
    try:
        return os.readlink(f"/proc/{pid}/ns/{kind}")
    except OSError:
        return ""


def check_tracefs() -> None:
    """tracefs at /sys/kernel/tracing: tracepoint ids and uprobe detach come from it. Missing e.g. under
    `ip netns exec`, which mounts the namespace's own /sys, where BCC's compile would fail in a page of errors."""
    if not (TRACEFS / "events").is_dir():
        hint = " (`ip netns exec` mounts the network namespace's own /sys: run aiflame outside it)" \
            if _ns("net", "self") != _ns("net", "1") else ""
        raise HostError(f"tracefs is not mounted at {TRACEFS}{hint}; mount it: mount -t tracefs nodev {TRACEFS}")


def check_pid(pid: int) -> None:
    state = status(pid)
    if state is None:
        raise TargetGone(f"no such process: {pid}")
    if state in GONE:
        raise TargetGone(f"process {pid} has already exited")


def check_out_dir(out_dir: Path) -> None:
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise BadInput(f"cannot create output directory {out_dir}: {e.strerror}") from None
    if not os.access(out_dir, os.W_OK | os.X_OK):
        raise BadInput(f"output directory not writable: {out_dir}")

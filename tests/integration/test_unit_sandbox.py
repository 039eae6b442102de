"""The systemd unit's sandbox, applied without systemd (CI's PID 1 is not systemd): the daemon runs with the unit's
capability bounding set and no-new-privileges, a read-only root except its output (ProtectSystem=strict,
ProtectHome=read-only) and, if the unit asked for it, a private /tmp. Under it the BPF program must compile (kernel
headers readable), and a job run from /tmp must come out with its functions and its kernel frames named."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from aiflame.core.capture import read_capture
from tests.conftest import REPO
from tests.integration.conftest import HANG_S, wait_until

UNIT = REPO / "deploy" / "aiflame-agent.service"
JOB = r"""
#include <fcntl.h>
#include <unistd.h>
static char buf[1 << 16];
__attribute__((noinline)) long job_TOKEN(int fd) {
    long n = 0; for (int i = 0; i < 64; i++) n += read(fd, buf, sizeof buf); return n; }
int main(void) { int fd = open("/dev/zero", O_RDONLY); long n = 0; for (;;) n += job_TOKEN(fd); return (int)n; }
"""


def _settings() -> dict[str, str]:
    out: dict[str, str] = {}
    for line in UNIT.read_text().splitlines():
        if "=" in line and not line.startswith(("#", "[")):
            key, _, value = line.partition("=")
            out[key.strip()] = value.strip()
    return out


def test_the_unit_parses(tmp_path: Path) -> None:
    if shutil.which("systemd-analyze") is None:
        pytest.fail("systemd-analyze missing: `make setup` installs systemd")
    # ExecStart names the installed /usr/local/bin/aiflame; verify a copy that runs this checkout's instead.
    unit = tmp_path / UNIT.name
    unit.write_text(UNIT.read_text().replace("/usr/local/bin/aiflame", str(Path(sys.executable).parent / "aiflame")))
    proc = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True)
    problems = [ln for ln in proc.stderr.splitlines() if UNIT.name in ln]
    assert not problems, proc.stderr


def test_daemon_under_the_units_sandbox(tmp_path: Path, request: pytest.FixtureRequest) -> None:
    unit = _settings()
    assert unit["ProtectSystem"] == "strict" and unit["NoNewPrivileges"] == "yes"
    caps = ",".join("+" + c.removeprefix("CAP_").lower() for c in unit["CapabilityBoundingSet"].split())
    # A job under /tmp (what PrivateTmp= would hide), built now so no symbol cache knows its build id.
    token = os.urandom(4).hex()
    (tmp_path / "job.c").write_text(JOB.replace("TOKEN", token))
    job = tmp_path / "aiflame_unit_job"
    subprocess.run(["gcc", "-O1", "-fno-omit-frame-pointer", "-o", str(job), str(tmp_path / "job.c")], check=True)
    # Output and socket outside /tmp (as /var/lib/aiflame and /run/aiflame are), so a private /tmp hides the job only.
    state = Path(tempfile.mkdtemp(prefix="aiflame-unit-test-", dir="/var/lib"))
    request.addfinalizer(lambda: shutil.rmtree(state, ignore_errors=True))
    out, sock = state / "out", state / "run" / "agent.sock"
    out.mkdir()
    sock.parent.mkdir()
    config = state / "aiflame.toml"
    # At this test's priority, by choice (nice 10 lets a CPU burner starve its trigger's compile past any sane
    # limit); the shipped 10 and the watchdog's own priority: test_daemon.py.
    config.write_text(f'[watch]\nnames = ["aiflame_unit_*"]\n[output]\ndir = "{out}"\n'
                      f'[control]\nsocket = "{sock}"\n[limits]\nnice = 0\n')
    # The unit's symbol cache: CacheDirectory= (systemd makes it writable) and AIFLAME_CACHE pointing into it.
    cache_dir = unit["CacheDirectory"]
    assert unit["Environment"].startswith(f"AIFLAME_CACHE=/var/cache/{cache_dir}/"), unit["Environment"]
    cache = state / "cache"
    cache.mkdir()
    rw = [str(out), str(sock.parent), str(cache)]  # the unit's ReadWritePaths and CacheDirectory, here
    script = "set -e\n" + "".join(f"mount --bind {shlex.quote(p)} {shlex.quote(p)}\n" for p in rw)
    if unit.get("PrivateTmp") == "yes":
        script += "mount -t tmpfs tmpfs /tmp\n"
    script += "mount -o remount,bind,ro /\n" + "".join(f"mount -o remount,bind,rw {shlex.quote(p)}\n" for p in rw)
    if unit.get("ProtectKernelTunables") == "yes":  # /proc/sys and everything under /sys read-only
        script += ("mount --bind /proc/sys /proc/sys\nmount -o remount,bind,ro /proc/sys\n"
                   "for m in $(awk '$2 ~ \"^/sys\" {print $2}' /proc/self/mounts); do mount -o remount,bind,ro \"$m\"; "
                   "done\n")
    script += shlex.join(["exec", "setpriv", f"--bounding-set=-all,{caps}", "--no-new-privs", sys.executable, "-m",
                          "aiflame", "agent", "--config", str(config)])
    log = tmp_path / "agent.log"
    with open(log, "wb") as log_f:
        daemon = subprocess.Popen(["unshare", "--mount", "--propagation", "private", "bash", "-c", script], cwd=REPO,
                                  stdout=log_f, stderr=subprocess.STDOUT,
                                  env={**os.environ, "AIFLAME_CACHE": str(cache / "symbols")})
    work = None
    try:
        def started() -> bool:  # a cold compile cache: the BPF program compiles under the sandbox
            assert daemon.poll() is None, log.read_text()
            return b"INFO started" in log.read_bytes()

        wait_until(started, "the sandboxed daemon started")
        work = subprocess.Popen([str(job), "60"])
        trig = subprocess.run([sys.executable, "-m", "aiflame", "trigger", "--pid", str(work.pid), "-d", "3",
                               "--socket", str(sock)], cwd=REPO, capture_output=True, text=True, timeout=HANG_S)
        assert trig.returncode == 0, trig.stderr + log.read_text()
    finally:
        if work is not None:
            work.kill()
            work.wait()
        daemon.terminate()
        daemon.wait(HANG_S)
    assert daemon.returncode == 0, log.read_text()
    (cap_dir,) = (out / "captures").iterdir()
    cap = read_capture(cap_dir / "profile.aiflame")
    assert cap.samples and cap.kernel_symbols, "no samples, or kernel symbols unreadable (CAP_SYSLOG)"
    folded = (cap_dir / "profile.folded").read_text()
    # The job's function is named from the /tmp binary itself (readable by path when the capture is symbolized);
    # the kernel's frames from /proc/kallsyms.
    assert f"job_{token}" in folded and "read_zero_[k]" in folded, folded[:2000]
    assert any((cache / "symbols").iterdir()), "the symbol cache was not written"

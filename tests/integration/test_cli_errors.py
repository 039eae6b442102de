"""Bad input gets one clear line on stderr and a non-zero exit, never a traceback."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from aiflame.cli.main import main
from tests.conftest import REPO
from tests.integration.conftest import aiflame


def _one_line_error(proc: subprocess.CompletedProcess[str], pattern: str) -> None:
    assert proc.returncode != 0, proc.stdout
    assert "Traceback" not in proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, proc.stderr
    assert pattern in lines[0], lines[0]


def test_no_such_pid(tmp_path: Path) -> None:
    proc = aiflame("profile", "-p", "999999", "-o", str(tmp_path), check=False)
    _one_line_error(proc, "no such process: 999999")
    assert proc.returncode == 4  # TargetGone


def test_command_not_found(tmp_path: Path) -> None:
    _one_line_error(aiflame("profile", "-o", str(tmp_path), "--", "no-such-cmd-xyz", check=False),
                    "command not found: no-such-cmd-xyz")


def test_output_dir_not_writable(tmp_path: Path, examples: Path) -> None:
    f = tmp_path / "file"
    f.write_text("")
    _one_line_error(aiflame("profile", "-o", str(f / "sub"), "--", str(examples / "cpu_split"), "1", check=False),
                    "cannot create output directory")


def test_pid_and_command_together(tmp_path: Path) -> None:
    proc = aiflame("profile", "-p", "1", "--", "true", check=False)
    _one_line_error(proc, "not both")
    assert proc.returncode == 2


def test_nothing_to_profile() -> None:
    proc = aiflame("profile", check=False)
    _one_line_error(proc, "nothing to profile")
    assert proc.returncode == 2


def test_not_root(tmp_path: Path, examples: Path) -> None:
    if shutil.which("setpriv") is None:
        pytest.fail("setpriv (util-linux) is needed to run a command as another user")
    out = tmp_path / "o"
    out.mkdir()
    os.chmod(tmp_path, 0o777)
    proc = subprocess.run(
        ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-m", "aiflame", "profile",
         "-o", str(out), "--", str(examples / "cpu_split"), "1"],
        cwd=REPO, capture_output=True, text=True, timeout=60, env={**os.environ, "HOME": str(tmp_path)},
    )
    _one_line_error(proc, "must run as root")
    assert proc.returncode == 3  # HostError


def test_pid_exits_before_attach(tmp_path: Path) -> None:
    short = subprocess.Popen(["sleep", "0.3"])
    try:
        time.sleep(0.05)
        proc = aiflame("profile", "-p", str(short.pid), "-o", str(tmp_path), check=False)
    finally:
        short.wait()
    # Either the pid was gone before the checks (no such process) or died while BPF compiled.
    assert proc.returncode != 0
    assert "exited before the sampler attached" in proc.stderr or "has already exited" in proc.stderr \
        or "no such process" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


def test_bpf_compile_failure(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                             capsys: pytest.CaptureFixture[str]) -> None:
    from aiflame.agent.kernel import sampler
    # A real compile failure in the compiler process: its diagnostics on stderr, one line from us.
    monkeypatch.setattr(sampler, "program_text", lambda _config: "int broken( {")
    rc = main(["profile", "-q", "-o", str(tmp_path), "--", "true"])
    err = capsys.readouterr().err
    assert rc == 3  # a HostError: the host cannot run the BPF program
    assert "cannot load the BPF sampler" in err and "Traceback" not in err


@pytest.mark.parametrize("cmd", [["profile", "-q", "-d", "1", "--", "true"], ["agent"]])
def test_outside_the_host_pid_namespace(tmp_path: Path, cmd: list[str]) -> None:
    """In a container's PID namespace (its own /proc) BPF's host pids match nothing there: refuse, one line."""
    argv = ["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-m", "aiflame", *cmd]
    if cmd[0] == "profile":
        argv[-5:-5] = ["-o", str(tmp_path / "out")]
    else:
        (tmp_path / "c.toml").write_text(f'[output]\ndir = "{tmp_path}/o"\n[control]\nsocket = "{tmp_path}/s"\n')
        argv += ["--config", str(tmp_path / "c.toml")]
    proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=120)
    _one_line_error(proc, "PID namespace other than the host's")


@pytest.mark.parametrize("cmd", [["profile", "-q", "-d", "1", "--", "true"], ["top"]])
def test_inside_ip_netns_exec(tmp_path: Path, cmd: list[str]) -> None:
    """`ip netns exec` mounts the namespace's own /sys, without tracefs: refused before BCC's compile (which
    fails in a page of errors there), in one line that names the cause. The namespace is the test's own."""
    ns = f"aiflame-t{os.getpid()}"
    subprocess.run(["ip", "netns", "add", ns], check=True)
    try:
        argv = ["ip", "netns", "exec", ns, sys.executable, "-m", "aiflame", *cmd]
        if cmd[0] == "profile":
            argv[-5:-5] = ["-o", str(tmp_path / "out")]
        env = {**os.environ, "AIFLAME_BPF_CACHE": "off"}  # a cached program would skip the compile
        proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=120, env=env)
    finally:
        subprocess.run(["ip", "netns", "del", ns], check=False)
    _one_line_error(proc, "tracefs is not mounted at /sys/kernel/tracing (`ip netns exec`")


@pytest.mark.parametrize("content,pattern", [
    (b"", "not an aiflame capture"),
    (b"hello world, not a capture", "not an aiflame capture"),
    (b"AIFLCAP\n\x05ab", "truncated"),
])
def test_export_bad_captures(tmp_path: Path, content: bytes, pattern: str) -> None:
    bad = tmp_path / "bad.aiflame"
    bad.write_bytes(content)
    _one_line_error(aiflame("export", str(bad), "-f", "folded", check=False), pattern)


def test_export_missing_file_and_unknown_format(tmp_path: Path) -> None:
    _one_line_error(aiflame("export", str(tmp_path / "nope"), "-f", "folded", check=False), "No such file")
    _one_line_error(aiflame("export", str(tmp_path / "nope"), "-f", "gif", check=False), "unknown format")

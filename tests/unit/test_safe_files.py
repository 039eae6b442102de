"""core/safe_files.py against what a user can put where root reads and writes: terminals, FIFOs, devices and
symlinks in place of files, directories swapped or owned by someone else."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from aiflame.core.errors import Refused
from aiflame.core.safe_files import OutputDir, open_regular, read_regular, trusted_dir, write_atomic
from tests.hostile import NOBODY


def test_a_regular_file_is_read(tmp_path: Path) -> None:
    p = tmp_path / "f"
    p.write_bytes(b"hello")
    fd, st = open_regular(p)
    try:
        assert os.read(fd, 10) == b"hello" and st.st_size == 5
        assert os.get_inheritable(fd) is False
    finally:
        os.close(fd)
    assert read_regular(p, 5) == b"hello"
    with pytest.raises(Refused, match="more than the 4"):
        read_regular(p, 4)


@pytest.mark.parametrize("what", ["fifo", "dir", "devnull", "devzero-link"])
def test_anything_but_a_regular_file_is_refused_without_opening_it(tmp_path: Path, what: str) -> None:
    p = tmp_path / "lib.so"
    if what == "fifo":
        os.mkfifo(p)  # a blocking open would hang here: nothing writes to it
    elif what == "dir":
        p.mkdir()
    elif what == "devnull":
        p = Path("/dev/null")
    else:
        p.symlink_to("/dev/zero")  # read whole, it never ends
    t0 = time.monotonic()
    with pytest.raises(Refused, match="not a regular file"):
        open_regular(p)
    with pytest.raises(Refused):
        read_regular(p, 1 << 30)
    assert time.monotonic() - t0 < 1


def test_a_symlink_is_refused_when_not_followed(tmp_path: Path) -> None:
    (tmp_path / "real").write_bytes(b"x")
    (tmp_path / "link").symlink_to(tmp_path / "real")
    assert read_regular(tmp_path / "link", 1) == b"x"
    with pytest.raises(Refused, match="not a regular file"):
        open_regular(tmp_path / "link", follow=False)


def test_a_terminal_never_becomes_ours() -> None:
    """A session leader without a terminal (the daemon under systemd) opens a path that is a pty: a plain open
    would make it its controlling terminal, and ^C from its master would interrupt it."""
    script = textwrap.dedent("""
        import os
        from aiflame.core.errors import Refused
        from aiflame.core.safe_files import open_regular
        def tty():
            return int(open("/proc/self/stat").read().rsplit(")", 1)[1].split()[4])
        master, slave = os.openpty()  # O_NOCTTY: not ours yet
        name = os.ttyname(slave)
        os.close(slave)
        try:
            open_regular(name)
            print("opened")
        except Refused:
            print("refused")
        print(tty())
        os.open(name, os.O_RDONLY | os.O_NONBLOCK)  # what a plain open does: the test can tell
        print(tty() != 0)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=30,
                         start_new_session=True, env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["refused", "0", "True"]


def test_output_dir_replaces_a_planted_symlink_not_its_target(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_bytes(b"root's file")
    out = tmp_path / "out"
    out.mkdir()
    (out / "profile.aiflame.partial").symlink_to(victim)
    with OutputDir(out) as d:
        fd = d.create("profile.aiflame.partial", replace=True)
        os.write(fd, b"ours")
        os.close(fd)
        with pytest.raises(FileExistsError):
            d.create("profile.aiflame.partial")
    assert victim.read_bytes() == b"root's file"
    assert not (out / "profile.aiflame.partial").is_symlink()


def test_write_atomic_never_follows_a_symlink_at_the_name(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_bytes(b"root's file")
    (tmp_path / "x.svg").symlink_to(victim)
    write_atomic(tmp_path / "x.svg", b"<svg/>")
    assert victim.read_bytes() == b"root's file" and (tmp_path / "x.svg").read_bytes() == b"<svg/>"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["victim", "x.svg"]


def test_a_directory_swapped_after_opening_does_not_redirect_writes(tmp_path: Path) -> None:
    out, elsewhere = tmp_path / "out", tmp_path / "elsewhere"
    out.mkdir()
    elsewhere.mkdir()
    with OutputDir(out) as d:
        out.rename(tmp_path / "moved")
        out.symlink_to(elsewhere)
        d.write_atomic("f", b"data")
    assert (tmp_path / "moved" / "f").read_bytes() == b"data" and not list(elsewhere.iterdir())


def test_trusted_dir(tmp_path: Path) -> None:
    base = tmp_path / "t"
    fd = trusted_dir(base / "a" / "b")
    os.close(fd)
    assert stat.S_IMODE((base / "a" / "b").stat().st_mode) == 0o700
    theirs = base / "theirs"
    theirs.mkdir()
    os.chown(theirs, NOBODY, NOBODY)
    with pytest.raises(Refused, match=f"owned by uid {NOBODY}"):
        trusted_dir(theirs / "cache")
    shared = base / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    with pytest.raises(Refused, match="others can write"):
        trusted_dir(shared / "cache")
    sticky = base / "sticky"
    sticky.mkdir()
    os.chmod(sticky, 0o1777)  # like /tmp: fine above, never as the directory itself
    os.close(trusted_dir(sticky / "cache"))
    with pytest.raises(Refused):
        trusted_dir(sticky)
    (base / "link").symlink_to(base / "a")
    with pytest.raises(Refused, match="symlink"):
        trusted_dir(base / "link" / "b")
    with pytest.raises(Refused, match="absolute"):
        trusted_dir("relative/path")

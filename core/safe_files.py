"""Files that someone else names or controls: a path a watched process gave us, a directory another user owns.

The agent runs as root and reads what its targets point it at (library paths, `/proc/PID/map_files` links, files
in a stream directory anyone can write), and writes into output and cache directories a user may own. Plain
`open()` there lets that user choose what root opens or overwrites: a terminal (which becomes a session leader's
controlling terminal unless O_NOCTTY), a FIFO (blocks the reader), `/dev/zero` (never ends), a device whose
opening does something (`/dev/watchdog`), a symlink to a root-owned file (overwritten).

Reading (`open_regular`, `read_regular`): the path is first opened with O_PATH, which opens nothing (no driver
runs, no terminal is taken, a FIFO does not block); the type is checked on that handle, and only a regular file is
then opened for reading through `/proc/self/fd/N`, which reaches exactly the inode checked.

Writing (`OutputDir`, `write_atomic`): the directory is opened once, and every file in it is created relative to
that descriptor with O_CREAT|O_EXCL|O_NOFOLLOW and renamed into place the same way, so a symlink swapped in for a
file name or for the directory itself never redirects a write. `trusted_dir` opens a directory whose every
component only root or we can change: where code we load, or hand a target to load, may be kept.
"""

from __future__ import annotations

import errno
import os
import secrets
import stat
from collections.abc import Iterable
from typing import BinaryIO

from aiflame.core.errors import Refused

__all__ = ["READ_FLAGS", "OutputDir", "open_regular", "read_regular", "trusted_dir", "write_atomic"]

# For every read of a file someone else named: never a controlling terminal, never a blocking open.
READ_FLAGS = os.O_RDONLY | os.O_NOCTTY | os.O_NONBLOCK | os.O_CLOEXEC
_CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_NOCTTY | os.O_CLOEXEC


def _label(path: str | os.PathLike[str]) -> str:
    return os.fsdecode(path)


def open_regular(path: str | os.PathLike[str], *, follow: bool = True,
                 dir_fd: int | None = None) -> tuple[int, os.stat_result]:
    """An fd (O_RDONLY|O_NOCTTY|O_NONBLOCK|O_CLOEXEC, the caller's to close) and the stat of the regular file at
    `path`. `follow=False`: a symlink as the last component is refused. Raises OSError as os.open does, and
    Refused for anything but a regular file, which is never opened for reading at all."""
    flags = os.O_PATH | os.O_CLOEXEC | (0 if follow else os.O_NOFOLLOW)
    handle = os.open(path, flags, dir_fd=dir_fd)
    try:
        st = os.fstat(handle)
        if not stat.S_ISREG(st.st_mode):
            raise Refused(f"{_label(path)}: not a regular file")
        # Reopening the O_PATH handle through /proc reaches the inode just checked, whatever the path names now.
        fd = os.open(f"/proc/self/fd/{handle}", READ_FLAGS)
    finally:
        os.close(handle)
    return fd, st


def read_regular(path: str | os.PathLike[str], limit: int, *, follow: bool = True,
                 dir_fd: int | None = None) -> bytes:
    """The whole regular file at `path` (see open_regular), Refused when it holds more than `limit` bytes
    (checked on what is read, not only on the size the file claims)."""
    fd, st = open_regular(path, follow=follow, dir_fd=dir_fd)
    try:
        if st.st_size > limit:
            raise Refused(f"{_label(path)}: {st.st_size} bytes, more than the {limit} read from such a file")
        chunks: list[bytes] = []
        got = 0
        while got <= limit:
            chunk = os.read(fd, min(1 << 20, limit + 1 - got))
            if not chunk:
                break
            chunks.append(chunk)
            got += len(chunk)
        if got > limit:
            raise Refused(f"{_label(path)}: grew past the {limit} bytes read from such a file")
        return b"".join(chunks)
    finally:
        os.close(fd)


class OutputDir:
    """A directory we write files into, held by descriptor: names inside it are never followed as symlinks and
    the directory cannot be swapped for another under us. Close it (or use `with`)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = _label(path)
        self.fd = -1
        try:
            self.fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as e:
            raise Refused(f"{self.path}: {e.strerror or e}") from None

    @classmethod
    def adopt(cls, fd: int, path: str | os.PathLike[str]) -> OutputDir:
        """An OutputDir over the directory fd `fd` (now the OutputDir's to close), e.g. from trusted_dir."""
        d = cls.__new__(cls)
        d.path, d.fd = _label(path), fd
        return d

    @classmethod
    def of_file(cls, path: str | os.PathLike[str]) -> OutputDir:
        """The directory holding `path`."""
        return cls(os.path.dirname(os.path.abspath(os.fsdecode(path))))

    def create(self, name: str, mode: int = 0o666, *, replace: bool = False) -> int:
        """A new, empty file `name` open for writing (the fd is the caller's); FileExistsError when the name is
        taken, unless `replace`, which first removes the name itself (never what a symlink there points to)."""
        if replace:
            self.unlink(name)
        return os.open(name, _CREATE_FLAGS, mode, dir_fd=self.fd)

    def create_temp(self, name: str, mode: int = 0o666) -> tuple[int, str]:
        """A new file under a fresh random name next to `name` (hidden, ending in .tmp): (fd, its name)."""
        for _ in range(16):
            tmp = f".{name}.{secrets.token_hex(6)}.tmp"
            try:
                return os.open(tmp, _CREATE_FLAGS, mode, dir_fd=self.fd), tmp
            except FileExistsError:
                continue
        raise FileExistsError(f"{self.path}: no free temporary name for {name}")

    def rename(self, src: str, dst: str) -> None:
        """Rename within this directory (atomic; replaces `dst` itself, even when it is a symlink)."""
        os.replace(src, dst, src_dir_fd=self.fd, dst_dir_fd=self.fd)

    def unlink(self, name: str) -> None:
        """Remove `name` if it is there (a symlink is removed itself)."""
        try:
            os.unlink(name, dir_fd=self.fd)
        except FileNotFoundError:
            pass

    def write_atomic(self, name: str, data: bytes | Iterable[bytes | bytearray | memoryview],
                     mode: int = 0o666) -> None:
        """`name` holds `data` (bytes, or pieces written in turn) once this returns, or keeps what it held: a
        temporary file renamed into place."""
        fd, tmp = self.create_temp(name, mode)
        try:
            with os.fdopen(fd, "wb") as f:
                for piece in (data,) if isinstance(data, bytes) else data:
                    f.write(piece)
            self.rename(tmp, name)
        except BaseException:
            self.unlink(tmp)
            raise

    def fdopen(self, fd: int) -> BinaryIO:
        """A buffered binary writer over an fd from `create` or `create_temp`."""
        return os.fdopen(fd, "wb")

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> OutputDir:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if getattr(self, "fd", -1) >= 0:
            self.close()


def write_atomic(path: str | os.PathLike[str], data: bytes, mode: int = 0o666) -> None:
    """Write `data` to `path` through a temporary file renamed into place, both relative to the directory's
    descriptor (see OutputDir). OSError or Refused when it cannot."""
    name = os.path.basename(os.fsdecode(path))
    with OutputDir.of_file(path) as d:
        d.write_atomic(name, data, mode)


def _check_private(st: os.stat_result, label: str, last: bool) -> None:
    euid = os.geteuid()
    if not stat.S_ISDIR(st.st_mode):
        raise Refused(f"{label}: not a directory")
    if st.st_uid not in (0, euid):
        raise Refused(f"{label}: owned by uid {st.st_uid}, not by us or root")
    writable_by_others = st.st_mode & 0o022
    # A sticky directory others write into (/tmp) may lie above: nobody else can rename what we own there.
    if writable_by_others and (last or not st.st_mode & stat.S_ISVTX):
        raise Refused(f"{label}: others can write to it (mode {st.st_mode & 0o7777:o})")
    if last and st.st_uid != euid:
        raise Refused(f"{label}: not ours (owner uid {st.st_uid})")


def trusted_dir(path: str | os.PathLike[str], *, create: bool = True, mode: int = 0o700) -> int:
    """An fd of directory `path` (absolute) such that nobody but us and root can change what it holds: every
    component owned by root or us and not writable by others (a sticky one above, like /tmp, is fine), the last
    one ours; missing components are created with `mode`. Symlinks on the way are refused. Refused or
    OSError otherwise."""
    label = _label(path)
    if not os.path.isabs(label):
        raise Refused(f"{label}: not an absolute path")
    parts = [p for p in label.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise Refused(f"{label}: has '..' in it")
    fd = os.open("/", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        _check_private(os.fstat(fd), "/", not parts)
        for i, part in enumerate(parts):
            last = i == len(parts) - 1
            try:
                nxt = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            except FileNotFoundError:
                if not create:
                    raise
                try:
                    os.mkdir(part, mode, dir_fd=fd)
                except FileExistsError:
                    pass
                nxt = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            except OSError as e:
                if e.errno not in (errno.ENOTDIR, errno.ELOOP):
                    raise
                raise Refused(f"/{'/'.join(parts[:i + 1])}: not a directory (or a symlink)") from None
            os.close(fd)
            fd = nxt
            _check_private(os.fstat(fd), "/" + "/".join(parts[:i + 1]), last)
        return fd
    except BaseException:
        os.close(fd)
        raise

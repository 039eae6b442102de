"""Obfuscation for sharing: a transform of a `Profile` that replaces function, kernel, file, module and process
names with stable keyed hashes (HMAC-SHA256), keeping frame kinds, lines, stacks, sizes and timings. Applied
before any exporter, so folded stacks, SVG and Chakra traces all get the same names; the same key gives the same
name on every rank and every run. The key is a file that stays on the host (created 0600)."""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from dataclasses import replace
from pathlib import Path

from aiflame.core.errors import BadInput, Refused, Unreadable
from aiflame.core.model import Frame, FrameKind, Profile, Sample, Stack, TraceEvent

KEY_BYTES = 32
HASH_CHARS = 12  # 48 bits: collisions stay unlikely in any profile's name count
# Event args that carry names (kernel, communicator, process, file); numbers and op types are kept.
NAME_ARGS = frozenset({"name", "comm_name", "fatbin_file", "layout", "image", "inside"})
KEPT_META = frozenset({"frequency_hz"})
# Placeholders that name nothing.
KEPT_FRAMES = frozenset({"[unknown]", "[missing]", "[unwind stopped]", "[anon]", "-"})


def default_key_path() -> Path:
    """`$XDG_CONFIG_HOME/aiflame/obfuscate.key`, or `~/.config/aiflame/obfuscate.key`."""
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return Path(base) / "aiflame" / "obfuscate.key"


def parse_key(text: bytes, where: str = "key file") -> bytes:
    """The key in a key file: 64 hex digits (one line)."""
    try:
        word = text.decode("ascii").strip()
        key = bytes.fromhex(word)
    except (UnicodeDecodeError, ValueError):
        raise Unreadable(f"{where}: not a key (expected {2 * KEY_BYTES} hex digits)") from None
    if len(key) != KEY_BYTES:
        raise Unreadable(f"{where}: key has {len(key)} bytes, expected {KEY_BYTES}")
    return key


def load_key(path: Path, create: bool = True) -> bytes:
    """The key in `path`, made (0600, directories 0700) when absent and `create` is set. A key file others can
    read is refused: whoever holds the key can test guesses of the original names."""
    path = Path(path)
    if create and not path.exists():
        try:
            path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_hex(KEY_BYTES) + "\n")
        except FileExistsError:
            pass  # made at the same time by another run: use it
        except OSError as e:
            raise BadInput(f"cannot create key file {path}: {e.strerror or e}") from None
    try:
        st = path.stat()
        if st.st_mode & 0o077:
            raise Refused(f"key file {path} is readable by others (mode {st.st_mode & 0o777:o}); chmod 600")
        data = path.read_bytes()
    except OSError as e:
        raise Unreadable(f"cannot read key file {path}: {e.strerror or e}") from None
    return parse_key(data[:4096], str(path))


class Obfuscator:
    """Keyed, stable renaming. `name(kind, text)` is `<kind>_<hash>`; equal texts of a kind map to equal names."""

    def __init__(self, key: bytes) -> None:
        if len(key) != KEY_BYTES:
            raise Unreadable(f"key has {len(key)} bytes, expected {KEY_BYTES}")
        self._key = key
        self._cache: dict[tuple[str, str], str] = {}
        self._frames: dict[Frame, Frame] = {}
        self._stacks: dict[Stack, Stack] = {}

    def name(self, kind: str, text: str) -> str:
        if not text or text in KEPT_FRAMES:
            return text
        hit = self._cache.get((kind, text))
        if hit is None:
            digest = hmac.new(self._key, f"{kind}\0{text}".encode(), hashlib.sha256).hexdigest()
            hit = self._cache[(kind, text)] = f"{kind}_{digest[:HASH_CHARS]}"
        return hit

    def frame(self, f: Frame) -> Frame:
        hit = self._frames.get(f)
        if hit is None:
            if f.kind in (FrameKind.SEPARATOR, FrameKind.OFF_CPU):  # "-", "[off-cpu: nccl]": no names of theirs
                hit = f
            else:
                kind = {FrameKind.PROCESS: "proc", FrameKind.KERNEL: "kfn", FrameKind.ACCEL_SOURCE: "kernel",
                        FrameKind.ACCEL_INSTR: "instr", FrameKind.STALL: "stall"}.get(f.kind, "fn")
                hit = replace(f, name=self.name(kind, f.name), module=self.name("mod", f.module),
                              file=self.name("file", f.file))
            self._frames[f] = hit
        return hit

    def stack(self, st: Stack) -> Stack:
        hit = self._stacks.get(st)
        if hit is None:
            hit = self._stacks[st] = tuple(self.frame(f) for f in st)
        return hit

    def event(self, ev: TraceEvent) -> TraceEvent:
        named = ev.kind.value == "compute"  # kernels are named after the program; collectives after the runtime
        args = {k: (self.name(k, v) if k in NAME_ARGS and isinstance(v, str) else v) for k, v in ev.args.items()}
        return replace(ev, name=self.name("kernel", ev.name) if named else ev.name, stack=self.stack(ev.stack),
                       args=args)

    def profile(self, prof: Profile) -> Profile:
        """A copy of `prof` with every name replaced; counts, weights, times and structure unchanged."""
        def sample(s: Sample) -> Sample:
            return Sample(self.stack(s.stack), s.weight, s.pid, s.tid, self.name("proc", s.comm), s.cpu, s.time_ns)

        meta = {k: (v if k in KEPT_META else self.name(k, v)) for k, v in prof.meta.items()}
        meta["obfuscated"] = "yes"
        return Profile([sample(s) for s in prof.samples], [self.event(e) for e in prof.events], prof.unit, meta,
                       dict(prof.counters), prof.start_ns, prof.end_ns, [sample(s) for s in prof.off_cpu])

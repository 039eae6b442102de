"""The daemon's TOML configuration: typed settings with defaults that work without a file, and a validator
that meets every malformed file with one clear BadInput line."""

from __future__ import annotations

import re
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from aiflame.core.errors import BadInput, Unreadable

DEFAULT_CONFIG = Path("/etc/aiflame/aiflame.toml")


@dataclass(frozen=True)
class WatchConfig:
    """Which processes the daemon profiles. A process is watched when it maps an accelerator runtime (with
    `accelerators`) or matches any selector, and matches no `exclude` pattern."""

    accelerators: bool = True  # any process that maps CUDA runtime/driver, NCCL, Level Zero or libtorch
    names: tuple[str, ...] = ()  # shell globs on the process name (comm) or the executable's basename
    cmdlines: tuple[str, ...] = ()  # regular expressions searched in the command line (arguments joined by " ")
    cgroups: tuple[str, ...] = ()  # cgroup path prefixes, e.g. "/system.slice/train.service"
    exclude: tuple[str, ...] = ()  # shell globs on comm or executable basename: never watched
    scan_interval_s: float = 2.0  # how often /proc is scanned for new targets


@dataclass(frozen=True)
class ContinuousConfig:
    frequency: int = 19  # samples per second per CPU
    window_s: float = 60.0  # length of one rolling window
    runtimes: bool = True  # probe accelerator runtime calls (CUDA, NCCL, gloo, Level Zero) in targets
    # kernel launches recorded with their stack a second per CPU; those beyond are counted per kernel in BPF. Each
    # record costs the launching thread a stack walk (~12 us on a deep Python stack): at the daemon's rate the
    # launch view needs a few a second, not profile's 300.
    launch_stacks: int = 20


@dataclass(frozen=True)
class OutputConfig:
    dir: Path = Path("/var/lib/aiflame")  # windows/ and captures/ are created under it
    formats: tuple[str, ...] = ("folded",)  # exports written next to each window's capture


@dataclass(frozen=True)
class RetentionConfig:
    max_age_h: float = 72.0  # windows older than this are deleted
    max_total_mb: float = 2048.0  # the oldest windows go first when all windows together exceed this
    keep_captures: int = 50  # on-demand captures kept (the oldest beyond this are deleted)


@dataclass(frozen=True)
class TriggerConfig:
    default_duration_s: float = 10.0
    max_duration_s: float = 600.0
    default_frequency: int = 99
    max_frequency: int = 999


@dataclass(frozen=True)
class LimitsConfig:
    max_targets: int = 512  # processes discovery watches at once; more are reported, not followed
    # of them, at most this many of one user's (no user can crowd the others out); children a watched process
    # forks are followed as well, up to 8 x max_targets, and count for neither
    max_targets_per_user: int = 128
    max_probed_libraries: int = 64  # libraries holding runtime uprobes before they are all re-placed
    max_queued_exports: int = 4  # windows waiting for their folded export; beyond, exports are skipped
    nice: int = 10  # scheduling niceness of the daemon (never urgent); its stop watchdog keeps the one it started at


@dataclass(frozen=True)
class ControlConfig:
    socket: Path = Path("/run/aiflame/agent.sock")


@dataclass(frozen=True)
class DaemonConfig:
    watch: WatchConfig = field(default_factory=WatchConfig)
    continuous: ContinuousConfig = field(default_factory=ContinuousConfig)
    output: OutputConfig = field(default_factory=OutputConfig)
    retention: RetentionConfig = field(default_factory=RetentionConfig)
    trigger: TriggerConfig = field(default_factory=TriggerConfig)
    limits: LimitsConfig = field(default_factory=LimitsConfig)
    control: ControlConfig = field(default_factory=ControlConfig)
    source: str = "defaults"  # where it was read from (for logs and status)


# --- validation ------------------------------------------------------------------------------------------------

Check = Callable[[str, Any], Any]


def _bool(where: str, v: Any) -> bool:
    if not isinstance(v, bool):
        raise BadInput(f"{where}: expected true or false, got {_show(v)}")
    return v


def _number(lo: float, hi: float) -> Check:
    def check(where: str, v: Any) -> float:
        if isinstance(v, bool) or not isinstance(v, int | float):
            raise BadInput(f"{where}: expected a number, got {_show(v)}")
        if not lo <= v <= hi:
            raise BadInput(f"{where}: {v} is out of range ({lo:g} to {hi:g})")
        return float(v)
    return check


def _int(lo: int, hi: int) -> Check:
    def check(where: str, v: Any) -> int:
        if isinstance(v, bool) or not isinstance(v, int):
            raise BadInput(f"{where}: expected an integer, got {_show(v)}")
        if not lo <= v <= hi:
            raise BadInput(f"{where}: {v} is out of range ({lo} to {hi})")
        return v
    return check


def _strings(item: Check | None = None) -> Check:
    def check(where: str, v: Any) -> tuple[str, ...]:
        if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
            raise BadInput(f"{where}: expected a list of strings, got {_show(v)}")
        for s in v:
            if not s or "\0" in s:
                raise BadInput(f"{where}: empty or NUL-containing entry")
            if item:
                item(where, s)
        return tuple(v)
    return check


def _regex(where: str, s: str) -> None:
    try:
        re.compile(s)
    except re.error as e:
        raise BadInput(f"{where}: bad regular expression {s!r}: {e}") from None


def _cgroup(where: str, s: str) -> None:
    if not s.startswith("/"):
        raise BadInput(f"{where}: cgroup paths start with '/', got {s!r}")


def _abs_path(where: str, v: Any) -> Path:
    if not isinstance(v, str) or not v.startswith("/") or "\0" in v:
        raise BadInput(f"{where}: expected an absolute path, got {_show(v)}")
    p = Path(v)
    if ".." in p.parts:
        raise BadInput(f"{where}: '..' is not allowed in {v!r}")
    return p


def _formats(where: str, v: Any) -> tuple[str, ...]:
    from aiflame.exporters import REGISTRY

    out: tuple[str, ...] = _strings()(where, v)
    for f in out:
        if f not in REGISTRY:
            raise BadInput(f"{where}: unknown format {f!r} (known: {', '.join(REGISTRY)})")
    return out


def _show(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 40 else text[:37] + "..."


_SECTIONS: dict[str, tuple[type, dict[str, Check]]] = {
    "watch": (WatchConfig, {
        "accelerators": _bool, "names": _strings(), "cmdlines": _strings(_regex), "cgroups": _strings(_cgroup),
        "exclude": _strings(), "scan_interval_s": _number(0.1, 3600),
    }),
    "continuous": (ContinuousConfig, {
        "frequency": _int(1, 1000), "window_s": _number(1, 86400), "runtimes": _bool,
        "launch_stacks": _int(0, 1_000_000),
    }),
    "output": (OutputConfig, {"dir": _abs_path, "formats": _formats}),
    "retention": (RetentionConfig, {
        "max_age_h": _number(0.001, 24 * 3650), "max_total_mb": _number(1, 1 << 30), "keep_captures": _int(1, 100000),
    }),
    "trigger": (TriggerConfig, {
        "default_duration_s": _number(0.1, 86400), "max_duration_s": _number(0.1, 86400),
        "default_frequency": _int(1, 20000), "max_frequency": _int(1, 20000),
    }),
    "limits": (LimitsConfig, {
        "max_targets": _int(1, 16384), "max_targets_per_user": _int(1, 16384), "max_probed_libraries": _int(1, 4096),
        "max_queued_exports": _int(1, 1000), "nice": _int(0, 19),
    }),
    "control": (ControlConfig, {"socket": _abs_path}),
}


def parse_config(text: str, source: str = "config") -> DaemonConfig:
    """Parse and validate TOML text; missing sections and keys keep their defaults."""
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise Unreadable(f"{source}: not valid TOML: {e}") from None
    parts: dict[str, Any] = {}
    for name, value in doc.items():
        if name not in _SECTIONS:
            raise BadInput(f"{source}: unknown section [{name}] (known: {', '.join(_SECTIONS)})")
        cls, checks = _SECTIONS[name]
        if not isinstance(value, dict):
            raise BadInput(f"{source}: [{name}] must be a table")
        kwargs = {}
        for key, v in value.items():
            if key not in checks:
                known = ", ".join(f.name for f in fields(cls))
                raise BadInput(f"{source}: unknown key {key!r} in [{name}] (known: {known})")
            kwargs[key] = checks[key](f"{source}: [{name}] {key}", v)
        parts[name] = cls(**kwargs)
    cfg = DaemonConfig(**parts, source=source)
    t = cfg.trigger
    if t.default_duration_s > t.max_duration_s or t.default_frequency > t.max_frequency:
        raise BadInput(f"{source}: [trigger] defaults exceed the maximums")
    return cfg


def load_config(path: Path | None) -> DaemonConfig:
    """The configuration in `path`; None means DEFAULT_CONFIG when it exists, else the built-in defaults."""
    if path is None:
        if not DEFAULT_CONFIG.exists():
            return DaemonConfig()
        path = DEFAULT_CONFIG
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise Unreadable(f"cannot read config {path}: {e.strerror}") from None
    try:
        text = raw.decode()
    except UnicodeDecodeError:
        raise Unreadable(f"{path}: not UTF-8 text") from None
    return parse_config(text, str(path))

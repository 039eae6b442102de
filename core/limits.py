"""How much of what someone else controls we take in: sizes a file or a watched process declares (an ELF
section, a compressed payload, a code object in memory) are checked here before anything is read or inflated.

Offline commands (export, report) read files the user chose and keep the generous defaults; the agent, which
reads whatever its targets point it at as root, runs under `AGENT_LIMITS` (`use(AGENT_LIMITS)` at its start),
small enough that one hostile input cannot take its memory. On top of the per-item caps, an `Allowance` bounds
what one watched process can make us inflate or copy in all: the agent charges a target's work to it with
`charged_to(allowance)`, and every inflation or copy inside that block is counted against it.
"""

from __future__ import annotations

import contextvars
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from aiflame.core.errors import Refused

# Kernel launch records with a stack a second per CPU, by default (`profile --launch-stacks`): the agent's CPU stays
# under 5 % of a core at 10k launches/s from Python (BENCHMARKS.md; 2000 cost 23 %). Launches past it are counted
# in BPF, per kernel, exactly.
LAUNCH_STACKS = 300

__all__ = ["AGENT_LIMITS", "Allowance", "Limits", "charge", "charged_to", "current", "use"]


@dataclass(frozen=True)
class Limits:
    """Caps in bytes on one item each."""

    section_bytes: int = 4 << 30  # one ELF section read whole, or inflated
    payload_bytes: int = 1 << 30  # one fatbin entry (cubin, PTX) decompressed; one device-code file read whole
    copy_bytes: int = 512 << 20  # one code object copied from a live process's memory
    target_bytes: int = 1 << 40  # everything inflated or copied for one watched process (an Allowance's size)


# The agent's: the largest real whole-section read we know (libtorch_cpu.so's .strtab, 76 MB) fits, and one item
# costs at most twice its cap at a time (a section's compressed bytes and their inflation; a cubin and the copy
# without its padding), which keeps a ~70 MB agent under 300 MB whatever a target hands it. A target may make us
# inflate or copy 512 MiB in all.
AGENT_LIMITS = Limits(section_bytes=112 << 20, payload_bytes=96 << 20, copy_bytes=64 << 20, target_bytes=512 << 20)

_limits = Limits()


def current() -> Limits:
    """The caps in force."""
    return _limits


def use(limits: Limits) -> Limits:
    """Put `limits` in force for this process; returns the previous ones."""
    global _limits
    old, _limits = _limits, limits
    return old


class Allowance:
    """Bytes one watched process may still make us inflate or copy."""

    def __init__(self, label: str, total: int | None = None) -> None:
        self.label = label
        self.left = current().target_bytes if total is None else total
        self.refused = 0  # charges refused

    def take(self, n: int, what: str) -> None:
        if n > self.left:
            self.refused += 1
            raise Refused(f"{what}: {n} bytes would pass what {self.label} may make us read "
                          f"({self.left} bytes left)")
        self.left -= n


_allowance: contextvars.ContextVar[Allowance | None] = contextvars.ContextVar("aiflame_allowance", default=None)


@contextmanager
def charged_to(allowance: Allowance | None) -> Iterator[None]:
    """Inflations and copies in this block are charged to `allowance` (None: to nobody)."""
    token = _allowance.set(allowance)
    try:
        yield
    finally:
        _allowance.reset(token)


def charge(n: int, what: str, cap: int) -> None:
    """Take `n` bytes of `what` in: Refused when above `cap` (one of current()'s fields) or above what
    the process being served may still take (see charged_to)."""
    if n > cap:
        raise Refused(f"{what}: {n} bytes, more than the {cap} taken in one piece")
    allowance = _allowance.get()
    if allowance is not None:
        allowance.take(n, what)

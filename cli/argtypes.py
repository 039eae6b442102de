"""Validated argument types shared by the `aiflame` subcommands: each turns a command-line string into a value or
raises argparse's error, which `aiflame.cli.main` prints as one line."""

from __future__ import annotations

import argparse
from collections.abc import Callable


def positive_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not v > 0:  # also refuses nan
        raise argparse.ArgumentTypeError("must be > 0")
    return v


def frequency(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if not 1 <= v <= 20000:
        raise argparse.ArgumentTypeError("must be between 1 and 20000 Hz")
    return v


def pid(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a process id: {text!r}") from None
    if v <= 0:
        raise argparse.ArgumentTypeError("must be > 0")
    return v


def int_range(lo: int, hi: int) -> Callable[[str], int]:
    """An integer (decimal or 0x...) in [lo, hi]."""

    def parse(text: str) -> int:
        try:
            v = int(text, 0)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if not lo <= v <= hi:
            raise argparse.ArgumentTypeError(f"must be between {lo} and {hi}")
        return v

    return parse


def wall_time(text: str) -> int:
    """An instant as ns since the epoch: ISO 8601 with a zone (2026-11-28T09:00:00Z, +01:00), or epoch seconds."""
    import datetime

    try:
        return round(float(text) * 1e9)
    except ValueError:
        pass
    try:
        t = datetime.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a time: {text!r} (ISO 8601 with a zone, or epoch seconds)") from None
    if t.tzinfo is None:
        raise argparse.ArgumentTypeError(f"{text!r} has no time zone (add Z or +HH:MM: every node must agree)")
    return round(t.timestamp() * 1e9)

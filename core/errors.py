"""The one error hierarchy. Every error aiflame expects to meet is one of the few kinds below, each a thing the
user is told and acts on differently; the kind is decided where the error is raised, with a one-line message
that already names what and where ("libfoo.so: fatbin at 0x40: bad magic"), and the command line prints it as
`aiflame: error: <message>` with the kind's exit status (README, "Exit status").

    AiflameError                 (a kind below, never raised itself)
      UsageError        2        arguments that do not fit together
      BadInput          1        the user's file, flag or config is wrong
        Unreadable               outside data could not be read: missing, cut short, corrupt, of another format
          Refused                  not read (or written) on purpose: not a regular file, in a directory others
                                   can change, larger than we take in
        NothingToShow            the input holds nothing for what was asked (no launches, no stalls, no such
                                 symbol in the capture)
      HostError         3        this host cannot do it: not root, no BPF, no CUPTI, a Python we cannot walk
      TargetGone        4        the process to profile or read is gone, or its memory could not be read
      InternalError     70       a bug of ours

A caller that goes on past a failure (skip one bad fatbin, keep the old configuration) catches the kind and
guards only the call it means to. The few classes besides these are private control flow that never reaches the
user (tests/unit/test_errors.py lists them)."""

from __future__ import annotations

__all__ = ["AiflameError", "BadInput", "HostError", "InternalError", "NothingToShow", "Refused", "TargetGone",
           "Unreadable", "UsageError"]


class AiflameError(Exception):
    """An error with a one-line message for the user. Raise one of the kinds below, which says what it is."""

    exit_code = 1


class UsageError(AiflameError):
    """The arguments do not fit together in a way the parser cannot check (give --pid or a command, not both), or
    the parser refused them."""

    exit_code = 2


class BadInput(AiflameError):
    """Something the user gave us is wrong: an option value, a file, a capture, a config."""

    exit_code = 1


class Unreadable(BadInput):
    """Data made elsewhere cannot be read: a missing or truncated file, a corrupt or foreign format (ELF, DWARF,
    CFI, fatbin, cubin, a capture, a vendor's stall records, a config, a control message), or memory of a
    process that is not the object it should be."""


class Refused(Unreadable):
    """A file or directory we do not read or write on purpose: not a regular file, in a directory someone else can
    change, or larger than we take in (core/limits.py). Readers treat it as unreadable."""


class NothingToShow(BadInput):
    """The input is well formed but holds nothing for what was asked: no kernel launches, stall samples, off-CPU
    time or collectives in the capture, no such symbol or binary in it."""


class HostError(AiflameError):
    """This host is not set up for what was asked (no BPF, no headers, not root) or does not support it."""

    exit_code = 3


class TargetGone(AiflameError):
    """The process to profile or read does not exist (any more), or its memory could not be read."""

    exit_code = 4


class InternalError(AiflameError):
    """A bug of ours, reported as one line rather than a traceback."""

    exit_code = 70

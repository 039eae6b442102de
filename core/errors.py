"""The one error hierarchy. Every error aiflame expects to meet derives from `AiflameError` through one of the
few kinds a user acts on differently; each carries its one-line message, and the command line turns it into
`aiflame: error: <message>` and the kind's exit status (README, "Exit status")."""

from __future__ import annotations


class AiflameError(Exception):
    """An error with a one-line message for the user. Use a subclass that says what kind it is."""

    exit_code = 1


class BadInput(AiflameError):
    """Something the user or a watched process gave us is wrong: a file, a capture, a config, an argument."""

    exit_code = 1


class HostError(AiflameError):
    """This host is not set up for what was asked (no BPF, no headers, not root) or does not support it."""

    exit_code = 3


class TargetGone(AiflameError):
    """The process to profile or read does not exist (any more), or could not be read."""

    exit_code = 4


class InternalError(AiflameError):
    """A bug of ours, reported as one line rather than a traceback."""

    exit_code = 70

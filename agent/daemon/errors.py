"""The daemon's own error: it cannot start (socket, output directory, permissions); one line."""

from __future__ import annotations

from aiflame.core.errors import HostError


class DaemonError(HostError):
    """The daemon cannot start; one line."""

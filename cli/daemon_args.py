"""What `aiflame agent`, `trigger`, `status` and `top` share: their examples, the `--socket` option, and a
request to the running daemon that fails as one line when refused. The daemon itself is agent/daemon/."""

from __future__ import annotations

import argparse
from typing import Any

from aiflame.agent.daemon.config import ControlConfig
from aiflame.agent.daemon.protocol import Request, request
from aiflame.core.errors import BadInput

DEFAULT_SOCKET = str(ControlConfig().socket)

EXAMPLES = """examples:
  aiflame agent                                 run the daemon with /etc/aiflame/aiflame.toml or defaults
  aiflame agent --config ./aiflame.toml         run it with another configuration
  aiflame trigger --pid 4242 -d 30 -F 499       a 30 s high-resolution capture of one process
  aiflame trigger --all --chakra                every watched process, default duration, Chakra too
  aiflame status                                watched processes, rates, windows, losses, daemon cost
  aiflame top --pid 4242                        live view of the hottest stacks, kernels and collectives
"""


def add_socket(p: argparse.ArgumentParser) -> None:
    p.add_argument("--socket", default=DEFAULT_SOCKET, metavar="PATH",
                   help=f"the daemon's control socket (default {DEFAULT_SOCKET})")


def ask(socket: str, req: Request, timeout_s: float) -> dict[str, Any]:
    """The daemon's answer to `req`; BadInput when it cannot be reached or refuses."""
    resp = request(socket, req, timeout_s)
    if not resp.ok:
        raise BadInput(resp.error or "the daemon refused the request")
    return resp.data

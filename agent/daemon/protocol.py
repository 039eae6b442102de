"""The control protocol between `aiflame trigger/status/top` and the daemon: one JSON object per line over a
Unix socket, one request and one response per connection. Requests are outside data: `parse_request` checks
every field and meets anything else with one Unreadable line. A request names no paths and no commands;
the daemon chooses where output goes."""

from __future__ import annotations

import json
import socket
import struct
from dataclasses import dataclass, field
from typing import Any

from aiflame.core.errors import BadInput, Unreadable

MAX_MESSAGE = 64 * 1024  # a request is a few hundred bytes; a status reply a few KiB per target
MAX_PIDS = 1024
PROTOCOL_VERSION = 1


@dataclass(frozen=True)
class StatusRequest:
    pass


@dataclass(frozen=True)
class TriggerRequest:
    pids: tuple[int, ...] = ()  # empty with all_targets: every watched process
    all_targets: bool = False
    duration_s: float | None = None  # None: the daemon's default
    frequency: int | None = None
    chakra: bool = False
    at_wall_ns: int | None = None  # start the window at this CLOCK_REALTIME instant (every node of a job alike)


@dataclass(frozen=True)
class LatestRequest:
    """The newest finished windows (for `aiflame top`)."""

    count: int = 1


Request = StatusRequest | TriggerRequest | LatestRequest


@dataclass
class Response:
    ok: bool
    error: str = ""
    data: dict[str, Any] = field(default_factory=dict)


def _expect(obj: dict[str, Any], allowed: set[str]) -> None:
    extra = set(obj) - allowed
    if extra:
        raise Unreadable(f"unknown field(s) in request: {', '.join(sorted(extra))}")


def _num(obj: dict[str, Any], key: str) -> float | None:
    v = obj.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int | float) or v != v:
        raise Unreadable(f"{key} must be a number")
    return float(v)


def parse_request(line: bytes) -> Request:
    """Decode and validate one request line."""
    if len(line) > MAX_MESSAGE:
        raise Unreadable("request too large")
    try:
        obj = json.loads(line)
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise Unreadable("request is not valid JSON") from None
    if not isinstance(obj, dict):
        raise Unreadable("request must be a JSON object")
    if obj.get("v", PROTOCOL_VERSION) != PROTOCOL_VERSION:
        raise Unreadable(f"unsupported protocol version {obj.get('v')!r} (this daemon speaks {PROTOCOL_VERSION})")
    op = obj.get("op")
    if op == "status":
        _expect(obj, {"op", "v"})
        return StatusRequest()
    if op == "latest":
        _expect(obj, {"op", "v", "count"})
        count = obj.get("count", 1)
        if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= 100:
            raise Unreadable("count must be an integer from 1 to 100")
        return LatestRequest(count)
    if op == "trigger":
        _expect(obj, {"op", "v", "pids", "all", "duration_s", "frequency", "chakra", "at_ns"})
        pids = obj.get("pids", [])
        if not isinstance(pids, list) or len(pids) > MAX_PIDS or not all(
                isinstance(p, int) and not isinstance(p, bool) and 0 < p < 1 << 22 for p in pids):
            raise Unreadable(f"pids must be a list of at most {MAX_PIDS} process ids")
        all_targets = obj.get("all", False)
        chakra = obj.get("chakra", False)
        if not isinstance(all_targets, bool) or not isinstance(chakra, bool):
            raise Unreadable("all and chakra must be true or false")
        if bool(pids) == all_targets:
            raise Unreadable("give either pids or all")
        duration = _num(obj, "duration_s")
        if duration is not None and not duration > 0:
            raise Unreadable("duration_s must be > 0")
        freq = obj.get("frequency")
        if freq is not None and (isinstance(freq, bool) or not isinstance(freq, int) or freq < 1):
            raise Unreadable("frequency must be a positive integer")
        at = obj.get("at_ns")
        if at is not None and (isinstance(at, bool) or not isinstance(at, int) or not 0 < at < 1 << 63):
            raise Unreadable("at_ns must be a positive integer (ns since the epoch)")
        return TriggerRequest(tuple(sorted(set(pids))), all_targets, duration, freq, chakra, at)
    raise Unreadable(f"unknown op {op!r} (known: status, trigger, latest)")


def encode_request(req: Request) -> bytes:
    if isinstance(req, StatusRequest):
        obj: dict[str, Any] = {"op": "status"}
    elif isinstance(req, LatestRequest):
        obj = {"op": "latest", "count": req.count}
    else:
        obj = {"op": "trigger", "chakra": req.chakra}
        if req.all_targets:
            obj["all"] = True
        else:
            obj["pids"] = list(req.pids)
        if req.duration_s is not None:
            obj["duration_s"] = req.duration_s
        if req.frequency is not None:
            obj["frequency"] = req.frequency
        if req.at_wall_ns is not None:
            obj["at_ns"] = req.at_wall_ns
    obj["v"] = PROTOCOL_VERSION
    return json.dumps(obj).encode() + b"\n"


def encode_response(resp: Response) -> bytes:
    return json.dumps({"ok": resp.ok, "error": resp.error, "data": resp.data}).encode() + b"\n"


def parse_response(line: bytes) -> Response:
    try:
        obj = json.loads(line)
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise Unreadable("the daemon sent a malformed reply") from None
    if not isinstance(obj, dict) or not isinstance(obj.get("ok"), bool) or not isinstance(obj.get("data", {}), dict):
        raise Unreadable("the daemon sent a malformed reply")
    return Response(obj["ok"], str(obj.get("error", "")), obj.get("data", {}))


def read_line(sock: socket.socket, limit: int = MAX_MESSAGE) -> bytes:
    """Bytes up to the first newline; BadInput past `limit` or when the peer closes first."""
    buf = bytearray()
    while b"\n" not in buf:
        try:
            chunk = sock.recv(4096)
        except TimeoutError:
            raise BadInput("timed out waiting for a message") from None
        except OSError as e:
            raise BadInput(f"connection lost: {e.strerror}") from None
        if not chunk:
            raise Unreadable("connection closed before a complete message")
        buf += chunk
        if len(buf) > limit and b"\n" not in buf[:limit + 1]:
            raise Unreadable("message too large")
    return bytes(buf[:buf.index(b"\n")])


def peer_uid(sock: socket.socket) -> int:
    """The uid of the process at the other end of a Unix socket (SO_PEERCRED: pid, uid, gid)."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _pid, uid, _gid = struct.unpack("3i", creds)
    return int(uid)


def request(path: str, req: Request, timeout_s: float) -> Response:
    """Send one request to the daemon at `path` and wait for its reply."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout_s)
    try:
        try:
            sock.connect(path)
        except FileNotFoundError:
            raise BadInput(f"no daemon is listening on {path} (is `aiflame agent` running?)") from None
        except PermissionError:
            raise BadInput(f"permission denied on {path}: the control socket is root-only (try sudo)") from None
        except ConnectionRefusedError:
            raise BadInput(f"no daemon is listening on {path} (stale socket)") from None
        except OSError as e:
            raise BadInput(f"cannot connect to {path}: {e.strerror}") from None
        try:
            sock.sendall(encode_request(req))
        except OSError as e:
            # the daemon may have answered and closed before reading (a refusal): its reply says why
            try:
                return parse_response(read_line(sock, 16 * MAX_MESSAGE))
            except (OSError, BadInput):
                raise BadInput(f"cannot talk to the daemon: {e.strerror}") from None
        return parse_response(read_line(sock, 16 * MAX_MESSAGE))
    finally:
        sock.close()

"""The control socket alone: a real Unix socket in a temp directory, a fake handler, and real clients
(protocol.request). The allowed uid is the test's own, so this runs without root."""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from aiflame.agent.daemon.control import ControlServer
from aiflame.agent.daemon.protocol import (
    Request,
    Response,
    StatusRequest,
    TriggerRequest,
    parse_response,
    read_line,
    request,
)
from aiflame.core.errors import HostError


def _handler(req: Request) -> Response:
    if isinstance(req, TriggerRequest):
        raise RuntimeError("the handler broke")
    return Response(True, data={"asked": type(req).__name__})


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ControlServer]:
    srv = ControlServer(tmp_path / "run" / "agent.sock", _handler, allowed_uid=os.getuid())
    srv.listen()
    srv.start()
    yield srv
    srv.close()


def test_requests_reach_the_handler(server: ControlServer) -> None:
    assert (server.path.stat().st_mode & 0o777) == 0o600
    resp = request(str(server.path), StatusRequest(), 5.0)
    assert resp.ok and resp.data == {"asked": "StatusRequest"}


def test_bad_requests_and_handler_errors_become_replies(server: ControlServer) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.connect(str(server.path))
        s.sendall(b'{"op": "format-disk"}\n')
        reply = s.recv(4096)
    assert b"bad request: unknown op" in reply
    resp = request(str(server.path), TriggerRequest((1,)), 5.0)
    assert not resp.ok and resp.error == "internal error"
    assert request(str(server.path), StatusRequest(), 5.0).ok  # still serving


def _answer_without_asking(path: Path) -> Response:
    """A refusal comes before the request is read (and the connection closes, so a client still sending it may
    see a broken pipe instead): connect and read."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(5.0)
        s.connect(str(path))
        return parse_response(read_line(s))


def test_other_users_are_refused(tmp_path: Path) -> None:
    srv = ControlServer(tmp_path / "agent.sock", _handler, allowed_uid=os.getuid() + 1)
    srv.listen()
    srv.start()
    try:
        reply = _answer_without_asking(srv.path)
    finally:
        srv.close()
    assert reply.error == "refused: only root may use the aiflame control socket"


def test_too_many_clients_at_once_are_turned_away(tmp_path: Path) -> None:
    release = threading.Event()
    serving = threading.Event()

    def slow(req: Request) -> Response:
        serving.set()
        release.wait(10)
        return Response(True)

    srv = ControlServer(tmp_path / "agent.sock", slow, allowed_uid=os.getuid(), max_clients=1)
    srv.listen()
    srv.start()
    got: list[Response] = []
    first = threading.Thread(target=lambda: got.append(request(str(srv.path), StatusRequest(), 10.0)))
    first.start()
    try:
        assert serving.wait(10)  # the first client holds the only slot
        assert _answer_without_asking(srv.path).error == "busy: too many control connections"
    finally:
        release.set()
        first.join(10)
        srv.close()
    assert got and got[0].ok


def test_sockets_in_the_way(tmp_path: Path, server: ControlServer) -> None:
    with pytest.raises(HostError, match="another daemon is listening"):
        ControlServer(server.path, _handler).listen()
    plain = tmp_path / "plain"
    plain.write_text("x")
    with pytest.raises(HostError, match="is not a socket"):
        ControlServer(plain, _handler).listen()
    stale = tmp_path / "stale.sock"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(stale))
    s.close()  # bound, never listening: what a daemon that died leaves
    srv = ControlServer(stale, _handler, allowed_uid=os.getuid())
    srv.listen()
    srv.start()
    try:
        assert request(str(stale), StatusRequest(), 5.0).ok
    finally:
        srv.close()
    assert not stale.exists()


def test_no_connection_is_accepted_once_stopping(tmp_path: Path) -> None:
    stopping = threading.Event()
    srv = ControlServer(tmp_path / "agent.sock", _handler, allowed_uid=os.getuid(),
                        serving=lambda: not stopping.is_set())
    srv.listen()
    srv.start()
    try:
        assert request(str(srv.path), StatusRequest(), 5.0).ok
        stopping.set()
        answered = 0
        for _ in range(3):  # an accept already waiting may take one more; no more after that
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.settimeout(1.0)
                s.connect(str(srv.path))  # the kernel queues it
                s.sendall(b'{"op": "status"}\n')
                try:
                    answered += bool(s.recv(10))
                except TimeoutError:
                    pass
        assert answered <= 1
    finally:
        srv.close()

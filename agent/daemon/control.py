"""The daemon's control socket: a root-only Unix socket (born 0600, and every peer's uid checked), one thread
that accepts, and one short-lived thread per client (at most MAX_CLIENTS at once) that reads one request
(agent.daemon.protocol), hands it to the daemon's handler and writes the reply. A client can never take the
daemon down: bad requests and handler errors become error replies."""

from __future__ import annotations

import logging
import os
import socket
import stat
import threading
from collections.abc import Callable
from pathlib import Path

from aiflame.agent.daemon.protocol import (
    Request,
    Response,
    encode_response,
    parse_request,
    peer_uid,
    read_line,
)
from aiflame.core.errors import BadInput, HostError

log = logging.getLogger("aiflame.daemon")

MAX_CLIENTS = 8  # control connections served at once
READ_TIMEOUT_S = 5.0


class ControlServer:
    """Serves `handle` on the socket at `path`: `listen()`, `start()`, and `close()` at the end."""

    def __init__(self, path: Path, handle: Callable[[Request], Response], allowed_uid: int = 0,
                 max_clients: int = MAX_CLIENTS, serving: Callable[[], bool] = lambda: True) -> None:
        self.path = path
        self.handle = handle
        self.serving = serving  # False once the daemon is stopping: no connection is accepted after the current
        self.allowed_uid = allowed_uid  # root; tests run as themselves
        self._clients = threading.BoundedSemaphore(max_clients)
        self._listener: socket.socket | None = None
        self._thread = threading.Thread(target=self._serve, name="aiflame-control", daemon=True)

    def listen(self) -> None:
        """Bind the socket (0600), replacing a stale one that no daemon answers on; HostError otherwise."""
        path = self.path
        try:
            path.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
            try:
                st = os.lstat(path)
                if not stat.S_ISSOCK(st.st_mode):
                    raise HostError(f"{path} exists and is not a socket; not touching it")
                probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                try:
                    probe.connect(str(path))
                    raise HostError(f"another daemon is listening on {path}")
                except (ConnectionRefusedError, FileNotFoundError):
                    os.unlink(path)  # stale: left by a daemon that died
                finally:
                    probe.close()
            except FileNotFoundError:
                pass
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            old_umask = os.umask(0o177)  # the socket is born 0600: no window where others may connect
            try:
                sock.bind(str(path))
            finally:
                os.umask(old_umask)
            os.chmod(path, 0o600)
            sock.listen(16)
        except OSError as e:
            raise HostError(f"cannot listen on {path}: {e.strerror}") from None
        self._listener = sock

    def start(self) -> None:
        """Accept connections on a thread of its own."""
        self._thread.start()

    def close(self) -> None:
        """Stop accepting and remove the socket file (clients being served finish on their own)."""
        if self._listener is not None:
            try:
                self._listener.shutdown(socket.SHUT_RDWR)  # wakes the control thread out of accept()
            except OSError:
                pass
            self._listener.close()
            self._listener = None
            try:
                os.unlink(self.path)
            except OSError:
                pass

    def _serve(self) -> None:
        while self.serving() and self._listener is not None:
            try:
                conn, _ = self._listener.accept()
            except (OSError, AttributeError):  # shut down (or closed under us): the daemon is stopping
                return
            if not self._clients.acquire(blocking=False):
                _reply(conn, Response(False, "busy: too many control connections"))
                continue
            threading.Thread(target=self._client, args=(conn,), name="aiflame-client", daemon=True).start()

    def _client(self, conn: socket.socket) -> None:
        try:
            uid = peer_uid(conn)
            if uid != self.allowed_uid:
                log.warning("refused control connection uid=%d", uid)
                _reply(conn, Response(False, "refused: only root may use the aiflame control socket"))
                return
            conn.settimeout(READ_TIMEOUT_S)
            try:
                req = parse_request(read_line(conn))
            except BadInput as e:
                log.warning("bad control request: %s", e)
                _reply(conn, Response(False, f"bad request: {e}"))
                return
            _reply(conn, self.handle(req))
        except Exception as e:  # a client must never take the daemon down
            log.error("control connection failed: %s", e)
            _reply(conn, Response(False, "internal error"))
        finally:
            self._clients.release()


def _reply(conn: socket.socket, resp: Response) -> None:
    try:
        conn.sendall(encode_response(resp))
    except OSError:
        pass
    finally:
        conn.close()

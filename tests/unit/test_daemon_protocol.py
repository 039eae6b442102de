"""The control protocol: requests round-trip, and anything malformed is a BadInput (fuzzed)."""

from __future__ import annotations

import json
import socket
import threading
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aiflame.agent.daemon.protocol import (
    LatestRequest,
    Response,
    StatusRequest,
    TriggerRequest,
    encode_request,
    encode_response,
    parse_request,
    parse_response,
    request,
)
from aiflame.core.errors import BadInput


@pytest.mark.parametrize("req", [
    StatusRequest(), LatestRequest(3), TriggerRequest((12, 40)), TriggerRequest(all_targets=True, duration_s=2.5,
                                                                              frequency=499, chakra=True),
    TriggerRequest((7,), at_wall_ns=1_790_000_000_123_456_789),
])
def test_round_trip(req: object) -> None:
    assert parse_request(encode_request(req).rstrip(b"\n")) == req  # type: ignore[arg-type]


def test_response_round_trip() -> None:
    r = Response(True, data={"dir": "/var/lib/aiflame/captures/x", "samples": 3})
    assert parse_response(encode_response(r)) == r


@pytest.mark.parametrize(("line", "message"), [
    (b"nope", "not valid JSON"),
    (b"[1]", "must be a JSON object"),
    (b'{"op": "run", "cmd": "rm -rf /"}', "unknown op 'run'"),
    (b'{"op": "trigger", "pids": [1], "output": "/etc/passwd"}', "unknown field(s) in request: output"),
    (b'{"op": "trigger", "pids": [], "all": false}', "give either pids or all"),
    (b'{"op": "trigger", "pids": [1], "all": true}', "give either pids or all"),
    (b'{"op": "trigger", "pids": [-3]}', "pids must be a list"),
    (b'{"op": "trigger", "pids": ["1"]}', "pids must be a list"),
    (b'{"op": "trigger", "all": true, "duration_s": -1}', "duration_s must be > 0"),
    (b'{"op": "trigger", "all": true, "duration_s": "10"}', "duration_s must be a number"),
    (b'{"op": "trigger", "all": true, "frequency": 1.5}', "frequency must be a positive integer"),
    (b'{"op": "trigger", "all": true, "at_ns": "soon"}', "at_ns must be a positive integer"),
    (b'{"op": "trigger", "all": true, "at_ns": -5}', "at_ns must be a positive integer"),
    (b'{"op": "status", "v": 9}', "unsupported protocol version"),
    (b'{"op": "latest", "count": 0}', "count must be an integer"),
    (b"{" * 70000, "request too large"),
])
def test_malformed_requests(line: bytes, message: str) -> None:
    with pytest.raises(BadInput) as e:
        parse_request(line)
    assert message in str(e.value)


_json = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=10),
                     lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4),
                     max_leaves=12)


@settings(max_examples=400, deadline=None)
@given(st.one_of(st.binary(max_size=300), _json.map(lambda v: json.dumps(v).encode()),
                 st.dictionaries(st.sampled_from(["op", "pids", "all", "duration_s", "frequency", "chakra", "v",
                                                  "count"]), _json, max_size=6).map(lambda v: json.dumps(v).encode())))
def test_fuzz_requests(line: bytes) -> None:
    try:
        req = parse_request(line)
    except BadInput:
        return
    if isinstance(req, TriggerRequest):
        assert bool(req.pids) != req.all_targets and all(p > 0 for p in req.pids)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=200))
def test_fuzz_responses(line: bytes) -> None:
    try:
        parse_response(line)
    except BadInput:
        pass


def test_a_reply_sent_before_the_request_was_read_is_read(tmp_path: Path) -> None:
    """The daemon refuses a client (not root) before reading its request and closes: a client still sending gets
    EPIPE, and must read the refusal rather than report a broken pipe (test_daemon saw it under load)."""
    path = str(tmp_path / "sock")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(1)

    def refuse() -> None:
        conn, _ = server.accept()
        conn.sendall(encode_response(Response(False, error="refused: the control socket is root-only")))
        conn.close()

    t = threading.Thread(target=refuse)
    t.start()
    try:  # a request far larger than the socket's buffer: the send is still going when the server closes
        reply = request(path, TriggerRequest(tuple(range(1, 400_000))), 10)
    finally:
        t.join()
        server.close()
    assert reply == Response(False, error="refused: the control socket is root-only")

"""Status requests alone: a control thread asks, the main loop (here the test) answers between its drains."""

from __future__ import annotations

import threading
import time
from typing import Any

from aiflame.agent.daemon.status import StatusBoard


def test_a_waiting_client_gets_a_fresh_status() -> None:
    woken = threading.Event()
    board = StatusBoard(woken.set, wait_s=10.0)
    board.publish({"n": 0})
    built = 0

    def build() -> dict[str, Any]:
        nonlocal built
        built += 1
        return {"n": built}

    board.answer(build)
    assert built == 0  # nobody asked: nothing built
    got: list[dict[str, Any]] = []
    client = threading.Thread(target=lambda: got.append(board.fresh()))
    client.start()
    assert woken.wait(5)
    while client.is_alive():
        board.answer(build)
        time.sleep(0.01)
    assert got == [{"n": 1}] and built == 1


def test_a_busy_loop_leaves_the_last_status() -> None:
    board = StatusBoard(lambda: None, wait_s=0.05)
    board.publish({"n": 7})
    t0 = time.monotonic()
    assert board.fresh() == {"n": 7}
    assert time.monotonic() - t0 < 2
    board.answer(lambda: {"n": 8})  # the late answer is for nobody: nothing is built
    assert board.fresh() == {"n": 7}

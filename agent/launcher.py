"""`aiflame profile -- CMD`: fork the command held at a gate, so the sampler targets it before its first
instruction, then let it run and collect its exit status. The command gets SIGTERM when we end, however we end
(PR_SET_PDEATHSIG: also killed -9), unless it is to be left running."""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import time

from aiflame.core.errors import BadInput

_PR_SET_PDEATHSIG = 1


class Launcher:
    """The command, forked and waiting at the gate until `release()`. `end_with_us`: it gets SIGTERM when the
    thread that forked it ends (our exit, or a kill -9 of us)."""

    def __init__(self, argv: list[str], env: dict[str, str] | None = None, end_with_us: bool = True) -> None:
        exe = shutil.which(argv[0])
        if exe is None:
            raise BadInput(f"command not found: {argv[0]}")
        gate_r, gate_w = os.pipe()
        err_r, err_w = os.pipe2(os.O_CLOEXEC)
        parent = os.getpid()
        pid = os.fork()
        if pid == 0:  # child: wait for the go byte, then exec
            try:
                os.close(gate_w)
                os.close(err_r)
                if end_with_us:
                    ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
                    if os.getppid() != parent:  # we died before it took effect
                        os._exit(126)
                signal.signal(signal.SIGINT, signal.SIG_DFL)
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                if os.read(gate_r, 1) != b"g":
                    os._exit(126)
                os.close(gate_r)
                os.execv(exe, argv) if env is None else os.execve(exe, argv, env)
            except OSError as e:
                os.write(err_w, str(e.strerror).encode())
            os._exit(127)
        os.close(gate_r)
        os.close(err_w)
        self.pid = pid
        self.exe = exe
        self._gate, self._err = gate_w, err_r
        self.exit_code: int | None = None

    def release(self) -> None:
        os.write(self._gate, b"g")
        os.close(self._gate)
        msg = os.read(self._err, 512)  # EOF once exec succeeded (close-on-exec)
        os.close(self._err)
        if msg:
            self.wait()
            raise BadInput(f"cannot run command: {msg.decode(errors='replace')}")

    def abort(self) -> None:
        try:
            os.close(self._gate)  # the child reads EOF and exits
        except OSError:
            pass
        self.wait()

    def poll(self) -> bool:
        """True once the command has exited."""
        if self.exit_code is not None:
            return True
        pid, status = os.waitpid(self.pid, os.WNOHANG)
        if pid == 0:
            return False
        self.exit_code = os.waitstatus_to_exitcode(status)
        return True

    def stop(self, signum: int, grace_s: float = 2.0) -> None:
        """Pass our interruption on to the command (a terminal's Ctrl-C reaches both anyway)."""
        if self.poll():
            return
        try:
            os.kill(self.pid, signum)
        except ProcessLookupError:
            return
        end = time.monotonic() + grace_s
        while time.monotonic() < end:
            if self.poll():
                return
            time.sleep(0.02)

    def wait(self) -> None:
        if self.exit_code is None:
            _, status = os.waitpid(self.pid, 0)
            self.exit_code = os.waitstatus_to_exitcode(status)

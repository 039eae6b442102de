"""How long `aiflame dump --pid PID` takes next to `py-spy dump -p PID`, on a CPython 3.12 target of four threads
(one spinning, three blocked). Figures: the whole command's wall time (interpreter start-up and imports included),
and the dump itself in-process (agent.dump.dump_process: stop, unwind, read Python frames, symbolize), each the
median of --runs after one warm-up run (the CFI tables and symbols are cached on disk by then). Run as root;
results go to bench/results/dump_time.json."""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import REPO, aiflame_cmd, conditions, save

from aiflame.agent.dump import dump_process
from aiflame.symbolize.native import NativeSymbolizer

TARGET = """
import threading, time
def spinner():
    while True: pass
def sleeper():
    while True: time.sleep(60)
ev = threading.Event()
for f in (spinner, sleeper, ev.wait):
    threading.Thread(target=f, daemon=True).start()
print("ready", flush=True)
ev.wait()
"""


def wall(cmd: list[str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(cmd, cwd=REPO, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--python", default="/root/.pyenv/versions/3.12.1/bin/python")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "target.py"
        script.write_text(TARGET)
        proc = subprocess.Popen([args.python, str(script)], stdout=subprocess.PIPE, text=True)
        try:
            assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
            pid = str(proc.pid)
            spy = str(Path(sys.executable).parent / "py-spy")
            cmds = {"aiflame_dump": aiflame_cmd("dump", "--pid", pid), "py_spy_dump": [spy, "dump", "-p", pid],
                    "aiflame_dump_nonblocking": aiflame_cmd("dump", "--pid", pid, "--nonblocking"),
                    "py_spy_dump_nonblocking": [spy, "dump", "--nonblocking", "-p", pid]}
            res: dict[str, object] = {}
            for name, cmd in cmds.items():
                wall(cmd)
                times = [wall(cmd) for _ in range(args.runs)]
                res[f"{name}_wall_median_s"] = round(statistics.median(times), 4)
            native = NativeSymbolizer()
            dump_process(proc.pid, native)
            inproc, held = [], []
            for _ in range(args.runs):
                t0 = time.perf_counter()
                r = dump_process(proc.pid, native)
                inproc.append(time.perf_counter() - t0)
                held.append(r.stopped_s)
            res["aiflame_dump_in_process_median_s"] = round(statistics.median(inproc), 4)
            res["aiflame_dump_target_stopped_median_s"] = round(statistics.median(held), 5)
        finally:
            proc.kill()
            proc.wait()
    res["conditions"] = conditions()
    print(res)
    save("dump_time", res)


if __name__ == "__main__":
    main()

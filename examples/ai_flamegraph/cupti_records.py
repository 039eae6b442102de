"""Write CUPTI PC-sampling records for the kernels a capture launched, as aiflame's CUPTI injection library
(agent/accel/cupti_inject.c) streams them on a GPU host: a reason table, the cubin, and CUpti_PCSamplingPCData
records (cubinCrc, pcOffset, functionIndex, functionName, stallReason[{index, samples}], correlationId).

This host has no GPU, so the sample COUNTS and REASONS are synthesized; everything they point at is real: the
cubin is the sm_90 code the capture stored from the profiled program, each pcOffset is an instruction of a
kernel that program launched, and the kernels are named as CUPTI names them (mangled). The model, stated:

  - a cell is (kernel, instruction, reason); its weight is
        threads the kernel's launches started (grid x block, from the capture's launch events)
      x the instruction's weight (table CLASSES below; x LOOP_FACTOR inside a backward branch's range)
      x the reason's probability for that instruction's class;
  - an instruction that reads a register written by an earlier global load (LDG, LD, ATOMG) is a
    `long_scoreboard` consumer, one that reads the result of LDS/MUFU/S2R a `short_scoreboard` consumer;
  - SAMPLES samples are drawn from those weights (a multinomial draw, random.Random(SEED)).
Correlation ids are 0, as in CUPTI's continuous mode, so the merge shares each kernel's samples over its
launch stacks in proportion to launches. The CRC that keys cubin and records is zlib.crc32 of the cubin
(CUPTI's own cuptiGetCubinCrc value would serve the same purpose).

Usage: python cupti_records.py CAPTURE -o STREAM [--samples N] [--seed S] [--arch SM]
"""

from __future__ import annotations

import argparse
import random
import re
import struct
import zlib
from collections import Counter
from pathlib import Path

from aiflame.core.capture import read_capture
from aiflame.core.model import EventKind
from aiflame.symbolize.accel.cubin import parse_cubin
from aiflame.symbolize.accel.sass import disassemble, find_nvdisasm
from aiflame.symbolize.objfmt.demangle import demangle, short_name
from aiflame.symbolize.stacks import symbolize_capture

SAMPLES = 6_000
SEED = 18
LOOP_FACTOR = 8
PREFIX = "smsp__pcsamp_warps_issue_stalled_"
# CUPTI's stall reasons (Nsight Compute's names); the index is this table's, as cuptiPCSamplingGetStallReasons
# hands out a device's own indices at run time.
REASONS = ("barrier", "branch_resolving", "dispatch_stall", "drain", "imc_miss", "lg_throttle", "long_scoreboard",
           "math_pipe_throttle", "membar", "mio_throttle", "misc", "no_instructions", "not_selected", "selected",
           "short_scoreboard", "sleeping", "tex_throttle", "wait", "warpgroup_arrive")
# class -> (instruction weight, {reason: probability})
CLASSES: dict[str, tuple[float, dict[str, float]]] = {
    "long_consumer": (8, {"long_scoreboard": 0.85, "wait": 0.05, "selected": 0.10}),
    "short_consumer": (4, {"short_scoreboard": 0.75, "wait": 0.05, "selected": 0.20}),
    "barrier": (6, {"barrier": 0.90, "selected": 0.10}),
    "global_mem": (2, {"lg_throttle": 0.50, "selected": 0.30, "wait": 0.20}),
    "shared_mem": (2, {"mio_throttle": 0.50, "selected": 0.30, "wait": 0.20}),
    "math": (2, {"math_pipe_throttle": 0.30, "wait": 0.40, "selected": 0.20, "not_selected": 0.10}),
    "branch": (1, {"branch_resolving": 0.60, "selected": 0.40}),
    "exit": (1, {"drain": 0.70, "selected": 0.30}),
    "other": (1, {"wait": 0.50, "selected": 0.30, "not_selected": 0.20}),
    "nop": (0, {}),
}
_REG = re.compile(r"\bR(\d+)\b")
_LONG = ("LDG", "LD.", "LD ", "ATOMG")
_SHORT = ("LDS", "MUFU", "S2R")


def _opcode(text: str) -> str:
    parts = text.split()
    return parts[1] if parts[0].startswith("@") and len(parts) > 1 else parts[0]


def classify(code: dict[int, str]) -> dict[int, tuple[str, float]]:
    """Offset -> (class, loop multiplier) for one kernel's SASS."""
    offsets = sorted(code)
    loops = []
    for off in offsets:
        m = re.search(r"\bBRA\s+(?:`\(\.L_\w+\)\s*)?(0x[0-9a-f]+)", code[off])
        if m and int(m.group(1), 16) < off:
            loops.append((int(m.group(1), 16), off))
    pending: dict[int, str] = {}  # register -> "long" / "short" (its value is still on its way)
    out: dict[int, tuple[str, float]] = {}
    for off in offsets:
        text = code[off]
        op = _opcode(text)
        operands = text.split(None, 2 if text.startswith("@") else 1)[-1] if " " in text else ""
        regs = [int(r) for r in _REG.findall(operands)]
        writes = re.match(r"R\d+\b", operands) is not None and not op.startswith(("ST", "RED"))
        dest, srcs = (regs[0], regs[1:]) if writes else (-1, regs)  # SASS puts the destination first
        waits = {pending[r] for r in srcs if r in pending}
        if op == "NOP":
            cls = "nop"
        elif "long" in waits:
            cls = "long_consumer"
        elif "short" in waits:
            cls = "short_consumer"
        elif op.startswith("BAR"):
            cls = "barrier"
        elif op.startswith(("LDG", "STG", "REDG", "ATOMG", "LD.", "ST.")):
            cls = "global_mem"
        elif op.startswith(("LDS", "STS")):
            cls = "shared_mem"
        elif op.startswith(("F", "MUFU", "HFMA", "HADD", "HMUL", "DFMA", "DADD", "DMUL")):
            cls = "math"
        elif op.startswith(("BRA", "BSSY", "BSYNC", "CALL", "RET", "JMP")):
            cls = "branch"
        elif op.startswith("EXIT"):
            cls = "exit"
        else:
            cls = "other"
        for r in srcs:
            pending.pop(r, None)  # waited for: ready from here on
        if dest >= 0:
            pending.pop(dest, None)
            if op.startswith(_LONG):
                pending[dest] = "long"
            elif op.startswith(_SHORT):
                pending[dest] = "short"
        loop = LOOP_FACTOR if any(lo <= off <= hi for lo, hi in loops) else 1
        out[off] = (cls, float(loop))
    return out


def _str(s: str) -> bytes:
    b = s.encode()
    return struct.pack("<H", len(b)) + b


def _rec(rtype: int, payload: bytes) -> bytes:
    return struct.pack("<HHI", rtype, 0, len(payload)) + payload


def build(capture: Path, samples: int, seed: int, arch: int) -> tuple[bytes, Counter[str]]:
    cap = read_capture(capture)
    prof = symbolize_capture(cap)
    launches = [e for e in prof.events if e.kind == EventKind.COMPUTE]
    if not launches:
        raise SystemExit(f"{capture}: no kernel launches in the capture")
    pid = launches[0].pid
    threads: Counter[str] = Counter()
    for e in launches:
        a = e.args
        threads[e.name] += (int(a.get("grid_x", 1)) * int(a.get("grid_y", 1)) * int(a.get("grid_z", 1))
                            * int(a.get("block_x", 1)) * int(a.get("block_y", 1)) * int(a.get("block_z", 1)))
    code = next((g for g in cap.gpu_code if g.kind == "cubin" and g.arch == arch and g.data), None)
    if code is None:
        raise SystemExit(f"{capture}: no sm_{arch} cubin stored")
    cubin = parse_cubin(code.data)
    if find_nvdisasm() is None:
        raise SystemExit("nvdisasm not found (the nvidia-cuda-nvdisasm wheel, installed by `make setup`)")
    sass = disassemble(code.data, code.digest) or {}
    names = demangle(cubin.kernels)
    cells: list[tuple[str, int, str]] = []
    weights: list[float] = []
    kernels = [k for k in cubin.kernels if short_name(names[k]) in threads]
    for k in kernels:
        for off, (cls, loop) in sorted(classify(sass.get(k, {})).items()):
            w, reasons = CLASSES[cls]
            for reason, p in reasons.items():
                cells.append((k, off, reason))
                weights.append(threads[short_name(names[k])] * w * loop * p)
    drawn = Counter(random.Random(seed).choices(range(len(cells)), weights=weights, k=samples))
    crc = zlib.crc32(code.data)
    index = {r: i for i, r in enumerate(REASONS)}
    per_pc: dict[tuple[str, int], list[tuple[int, int]]] = {}
    for i in sorted(drawn):
        k, off, reason = cells[i]
        per_pc.setdefault((k, off), []).append((index[reason], drawn[i]))
    fidx = {k: i for i, k in enumerate(cubin.kernels)}
    pcs = b""
    for (k, off), pairs in sorted(per_pc.items()):
        pcs += struct.pack("<QQIII", crc, off, fidx[k], 0, len(pairs)) + _str(k)
        pcs += b"".join(struct.pack("<II", i, n) for i, n in pairs)
    end_ns = max(e.start_ns + e.duration_ns for e in launches)
    start_ns = min(e.start_ns for e in launches)
    table = struct.pack("<II", 1, len(REASONS)) + b"".join(struct.pack("<I", i) + _str(PREFIX + r)
                                                          for i, r in enumerate(REASONS))
    stream = (struct.pack("<8sHHIQ", b"AIFLCUPT", 1, 24, pid, start_ns)
              + _rec(1, _str("note") + _str("synthesized by examples/ai_flamegraph/cupti_records.py: counts and "
                                            f"reasons drawn with seed {seed}, no GPU"))
              + _rec(3, struct.pack("<IIQ", 1, 0, start_ns))
              + _rec(4, table)
              + _rec(5, struct.pack("<IIQQ", 1, 1, crc, len(code.data)) + code.data)
              + _rec(6, struct.pack("<IIQQQQQBBHI", 1, len(per_pc), end_ns, 0, samples, 0, 0, 0, 0, 0, 0) + pcs)
              + _rec(8, b""))
    per_kernel: Counter[str] = Counter()
    for i, n in drawn.items():
        per_kernel[short_name(names[cells[i][0]])] += n
    return stream, per_kernel


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("capture", type=Path)
    ap.add_argument("-o", "--output", type=Path, required=True)
    ap.add_argument("--samples", type=int, default=SAMPLES)
    ap.add_argument("--seed", type=int, default=SEED)
    ap.add_argument("--arch", type=int, default=90, help="the SM whose cubin the records point into (default 90)")
    args = ap.parse_args()
    stream, per_kernel = build(args.capture, args.samples, args.seed, args.arch)
    args.output.write_bytes(stream)
    shares = ", ".join(f"{k} {n}" for k, n in per_kernel.most_common())
    print(f"wrote {args.output}: {args.samples} stall samples ({shares})")


if __name__ == "__main__":
    main()

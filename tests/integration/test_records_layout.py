"""The record layouts are defined once in bpf/aiflame.h; agent/kernel/records.py mirrors them. This test compiles the
real sampler and compares the compiler's view of the C structs with the Python mirror, field by field."""

from __future__ import annotations

import ctypes
import re
from typing import Any

from aiflame.agent.kernel.records import (
    CallRec,
    OffCpuEndRec,
    OpenRec,
    ProbeSpecRec,
    ProcRec,
    PyProcRec,
    RetRec,
    SampleRec,
    TargetFlag,
)
from aiflame.agent.kernel.sampler import CpuSampler, SamplerConfig, bpf_source
from aiflame.agent.kernel.unwind import MAX_MAPS, ROWS_EVICTED, ROWS_JIT, ROWS_PENDING, UnwindProc
from aiflame.core.unwind import STOPS, USED_FP, USED_SCAN
from aiflame.symbolize.objfmt import cfi


def _layout(t: Any) -> list[tuple[str, int, int]]:
    return [(name, getattr(t, name).offset, getattr(t, name).size) for name, *_ in t._fields_]


def test_c_and_python_layouts_agree() -> None:
    sampler = CpuSampler(SamplerConfig(probes=True, off_cpu=True), lambda s: None, lambda e: None)
    sampler.start([])
    mirrors: dict[str, Any] = {"sample_rec": SampleRec, "proc_rec": ProcRec, "py_proc": PyProcRec, "call_rec": CallRec,
               "ret_rec": RetRec, "open_rec": OpenRec, "probe_spec": ProbeSpecRec, "unwind_proc": UnwindProc,
               "unwind_rule": cfi.RULE, "offcpu_end_rec": OffCpuEndRec}
    try:
        layouts = sampler.layouts()
        assert layouts.keys() == mirrors.keys()
        for name, mirror in mirrors.items():
            fields, size = layouts[name]
            if mirror is cfi.RULE:  # a struct.Struct: <BBxxii> is cfa_type, rbp_type, pad, cfa_off, rbp_off
                assert [f[1:] for f in fields] == [(0, 1), (1, 1), (2, 2), (4, 4), (8, 4)] and size == cfi.RULE.size
                continue
            assert fields == _layout(mirror), name
            assert size == ctypes.sizeof(mirror), name
    finally:
        sampler.close()


def test_print_bpf_inlines_header_and_defines() -> None:
    text = bpf_source(SamplerConfig(follow_children=True))
    assert "#define AIFLAME_FOLLOW" in text
    assert "struct sample_rec {" in text and '#include "aiflame.h"' not in text


def test_target_flags_agree() -> None:
    text = bpf_source(SamplerConfig())
    defines = dict(re.findall(r"^#define (TARGET_\w+) (\d+)", text, re.M))
    assert defines == {"TARGET_ON": str(int(TargetFlag.ON)), "TARGET_PY": str(int(TargetFlag.PY))}


def test_unwind_constants_agree() -> None:
    """bpf/unwind.h's rule kinds, stop reasons and sizes are the ones the CFI compiler and the loader use."""
    text = bpf_source(SamplerConfig())
    d = {k: int(v, 0) for k, v in re.findall(r"^#define (\w+) (0x[0-9a-f]+u?|\d+)u?\b", text, re.M)
         if not v.endswith("u")} | {k: int(v.rstrip("u"), 0) for k, v in
                                   re.findall(r"^#define (\w+) (0x[0-9a-f]+)u\b", text, re.M)}
    kinds = {f"CFA_{name.upper()}": i for i, name in enumerate(cfi.CFA_KINDS)}
    assert {k: d[k] for k in kinds} == kinds
    assert (d["RBP_SAME"], d["RBP_AT_CFA"], d["RBP_INVALID"], d["RBP_AT_RBP"]) == (
        cfi.RBP_UNCHANGED, cfi.RBP_OFFSET, cfi.RBP_INVALID, cfi.RBP_AT_RBP)
    stops = {v: k for k, v in d.items() if k.startswith("UW_STOP_")}
    assert stops == {code: f"UW_STOP_{key.upper()}" for code, (key, _) in STOPS.items()}
    assert d["UW_USED_SCAN"] == USED_SCAN
    assert d["UW_USED_FP"] == USED_FP and d["AIFLAME_UNWIND_MAPS"] == MAX_MAPS and d["UW_ROWS_EVICTED"] == ROWS_EVICTED
    assert d["UW_ROWS_JIT"] == ROWS_JIT and d["UW_ROWS_PENDING"] == ROWS_PENDING

"""The record layouts are defined once in bpf/aiflame.h; agent/records.py mirrors them. This test compiles the
real sampler and compares the compiler's view of the C structs with the Python mirror, field by field."""

from __future__ import annotations

import ctypes
import re
from typing import Any

from aiflame.agent.kernel.records import CallRec, OpenRec, ProbeSpecRec, ProcRec, PyProcRec, RetRec, SampleRec
from aiflame.agent.kernel.sampler import CpuSampler, SamplerConfig, bpf_source


def _layout(t: Any) -> list[tuple[str, int, int]]:
    return [(name, getattr(t, name).offset, getattr(t, name).size) for name, *_ in t._fields_]


def test_c_and_python_layouts_agree() -> None:
    sampler = CpuSampler(SamplerConfig(probes=True), lambda s: None, lambda e: None)
    sampler.start([])
    mirrors = {"sample_rec": SampleRec, "proc_rec": ProcRec, "py_proc": PyProcRec, "call_rec": CallRec,
               "ret_rec": RetRec, "open_rec": OpenRec, "probe_spec": ProbeSpecRec}
    try:
        layouts = sampler.layouts()
        assert layouts.keys() == mirrors.keys()
        for name, mirror in mirrors.items():
            fields, size = layouts[name]
            assert fields == _layout(mirror), name
            assert size == ctypes.sizeof(mirror), name
    finally:
        sampler.close()


def test_print_bpf_inlines_header_and_defines() -> None:
    text = bpf_source(SamplerConfig(follow_children=True))
    assert "#define AIFLAME_FOLLOW" in text
    assert "struct sample_rec {" in text and '#include "aiflame.h"' not in text


def test_target_flags_agree() -> None:
    from aiflame.agent.kernel.sampler import TARGET_ON, TARGET_PY

    text = bpf_source(SamplerConfig())
    defines = dict(re.findall(r"^#define (TARGET_\w+) (\d+)", text, re.M))
    assert defines == {"TARGET_ON": str(TARGET_ON), "TARGET_PY": str(TARGET_PY)}

"""The record layouts are defined once in bpf/aiflame.h; agent/records.py mirrors them. This test compiles the
real sampler and compares BCC's view of the C structs with the Python mirror, field by field."""

from __future__ import annotations

import ctypes
from typing import Any

from aiflame.agent.records import ProcRec, PyProcRec, SampleRec
from aiflame.agent.sampler import CpuSampler, SamplerConfig, bpf_source


def _layout(t: Any) -> list[tuple[str, int, int]]:
    return [(name, getattr(t, name).offset, getattr(t, name).size) for name, *_ in t._fields_]


def test_c_and_python_layouts_agree() -> None:
    sampler = CpuSampler(SamplerConfig(), lambda s: None, lambda e: None)
    sampler.start([])
    try:
        c_sample, c_proc, c_py = sampler.layouts()
        assert _layout(c_py) == _layout(PyProcRec)
        assert ctypes.sizeof(c_py) == ctypes.sizeof(PyProcRec)
        assert _layout(c_sample) == _layout(SampleRec)
        assert _layout(c_proc) == _layout(ProcRec)
        assert ctypes.sizeof(c_sample) == ctypes.sizeof(SampleRec)
        assert ctypes.sizeof(c_proc) == ctypes.sizeof(ProcRec)
    finally:
        sampler.close()


def test_print_bpf_inlines_header_and_defines() -> None:
    text = bpf_source(SamplerConfig(follow_children=True))
    assert "#define AIFLAME_FOLLOW" in text
    assert "struct sample_rec {" in text and '#include "aiflame.h"' not in text

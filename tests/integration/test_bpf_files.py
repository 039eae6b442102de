"""Each BPF program file stands alone (issue #27): it includes the headers it uses and compiles by itself, and the
program text of a capture puts the files together with each header once. The compile goes through the agent's
compiler process (agent/kernel/bpf_object.py) without the cache, and loads no program (no verifier run)."""

from __future__ import annotations

import re

import pytest

from aiflame.agent.kernel import bpf_object
from aiflame.agent.kernel.bpf_cache import BpfCache
from aiflame.agent.kernel.sampler import BPF_DIR, UW_PROGS, SamplerConfig, program_file, program_text

FILES = sorted(p.name for p in BPF_DIR.glob("*.bpf.c"))


def test_the_files_are_the_three_programs() -> None:
    assert FILES == ["cpu_sampler.bpf.c", "offcpu.bpf.c", "runtime_probes.bpf.c"]


@pytest.mark.parametrize("name", FILES)
def test_file_compiles_alone(name: str) -> None:
    text = program_file(BPF_DIR / name)
    assert '#include "' not in text  # every header inlined
    obj = bpf_object.load(text, SamplerConfig(follow_children=True).cflags(), {}, [], cache=BpfCache(None))
    obj.close()


def test_program_text_holds_each_header_once() -> None:
    text = program_text(SamplerConfig(probes=True, off_cpu=True))
    for guard in ("AIFLAME_H", "AIFLAME_UNWIND_H", "AIFLAME_COMMON_H", "AIFLAME_PYTHON_H", "AIFLAME_WALK_H",
                  "AIFLAME_SAMPLE_H"):
        assert len(re.findall(rf"^#define {guard}$", text, re.M)) == 1, guard
    # the walk's tail-call programs, generated per kind from one definition (walk.h), are the ones the agent loads
    made = re.findall(r"^UW_(STEP|SCAN)_PROGRAM\((\w+),", text, re.M)
    generated = {f"uw_{kind}_{what.lower()}" for what, kind in made}
    assert generated == {p for names in UW_PROGS.values() for p in names if p.startswith("uw_")}

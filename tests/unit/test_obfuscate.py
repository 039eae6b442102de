"""Obfuscation: every name (function, kernel, file, module, process, target) replaced by a stable keyed hash, with
stacks, weights, sizes and times unchanged; the Chakra and folded outputs of an obfuscated profile keep their node
counts and sizes and carry none of the original names; key files are made 0600 and malformed ones refused."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aiflame.core.errors import Unreadable
from aiflame.core.model import Profile
from aiflame.exporters import get_exporter
from aiflame.exporters.chakra_nodes import build_traces, node_types
from aiflame.exporters.obfuscate import Obfuscator, load_key, parse_key
from tests.unit.test_chakra import gloo_job

SECRETS = ("train_step", "train.py", "sgemm_kernel", "libblas.so", "trainer_proc", "secret-host", "my_job.py")


def _profile() -> Profile:
    prof = gloo_job()
    prof.meta.update(host="secret-host", target="python my_job.py --lr 3", frequency_hz="99")
    for e in prof.events[:2]:
        e.args["name"] = "sgemm_kernel"
    return prof


def test_names_replaced_structure_kept(tmp_path: Path) -> None:
    prof = _profile()
    ob = Obfuscator(b"k" * 32).profile(prof)
    assert [s.weight for s in ob.samples] == [s.weight for s in prof.samples]
    assert [(s.time_ns, s.pid, s.tid, len(s.stack)) for s in ob.samples] == \
        [(s.time_ns, s.pid, s.tid, len(s.stack)) for s in prof.samples]
    assert [[f.kind for f in s.stack] for s in ob.samples] == [[f.kind for f in s.stack] for s in prof.samples]
    assert [(e.start_ns, e.duration_ns, e.args.get("bytes")) for e in ob.events] == \
        [(e.start_ns, e.duration_ns, e.args.get("bytes")) for e in prof.events]
    folded = get_exporter("folded").render(ob).decode()
    svg = get_exporter("svg").render(ob).decode()
    plain, hidden = build_traces(prof), build_traces(ob)
    for r in plain.ranks:
        a, b = plain.ranks[r].nodes, hidden.ranks[r].nodes
        assert node_types(a) == node_types(b)
        assert [(n.type, n.attrs.get("comm_size"), n.duration_ns, n.ctrl_deps, n.data_deps) for n in a] == \
            [(n.type, n.attrs.get("comm_size"), n.duration_ns, n.ctrl_deps, n.data_deps) for n in b]
    chakra_names = " ".join(n.name for t in hidden.ranks.values() for n in t.nodes)
    for text in (folded, svg, chakra_names, repr(ob.meta), repr([e.args for e in ob.events])):
        for secret in SECRETS:
            assert secret not in text, (secret, text[:200])
    assert ob.meta["frequency_hz"] == "99"


def test_stable_per_key_and_different_across_keys() -> None:
    a1, a2, b = Obfuscator(b"a" * 32), Obfuscator(b"a" * 32), Obfuscator(b"b" * 32)
    assert a1.name("fn", "forward") == a2.name("fn", "forward") != b.name("fn", "forward")
    assert a1.name("fn", "forward") != a1.name("fn", "backward")
    assert a1.name("fn", "[unknown]") == "[unknown]"


def test_key_file_made_private_and_reused(tmp_path: Path) -> None:
    path = tmp_path / "cfg" / "aiflame" / "key"
    key = load_key(path)
    assert len(key) == 32 and os.stat(path).st_mode & 0o777 == 0o600
    assert load_key(path) == key
    os.chmod(path, 0o644)
    with pytest.raises(Unreadable, match="readable by others"):
        load_key(path)
    os.chmod(path, 0o600)
    path.write_text("zz\n")
    with pytest.raises(Unreadable, match="not a key"):
        load_key(path)
    with pytest.raises(Unreadable, match="cannot read"):
        load_key(tmp_path / "absent", create=False)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=100))
def test_key_parser_fuzz(data: bytes) -> None:
    try:
        assert len(parse_key(data)) == 32
    except Unreadable:
        pass

"""The daemon's configuration parser: defaults, every documented key, and malformed files meeting one clear
BadInput line (property-tested on arbitrary documents)."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aiflame.agent.daemon.config import DaemonConfig, load_config, parse_config
from aiflame.core.errors import BadInput
from tests.conftest import REPO


def test_defaults_without_a_file(tmp_path: Path) -> None:
    cfg = parse_config("")
    assert cfg.continuous.frequency == 19 and cfg.continuous.window_s == 60 and cfg.continuous.launch_stacks == 20
    assert cfg.output.dir == Path("/var/lib/aiflame") and cfg.watch.accelerators
    assert cfg.control.socket == Path("/run/aiflame/agent.sock")


def test_shipped_sample_is_the_defaults() -> None:
    cfg = load_config(REPO / "deploy" / "aiflame.toml")
    assert cfg == DaemonConfig(source=cfg.source)


def test_values_are_read() -> None:
    cfg = parse_config("""
        [watch]
        names = ["train*"]
        cmdlines = ["--model\\\\s"]
        cgroups = ["/system.slice/train.service"]
        exclude = ["jupyter*"]
        [continuous]
        frequency = 49
        window_s = 5.5
        launch_stacks = 0
        [output]
        dir = "/srv/prof"
        formats = ["folded", "svg"]
        [retention]
        max_age_h = 1
        max_total_mb = 10
    """, "t.toml")
    assert cfg.watch.names == ("train*",) and cfg.watch.cmdlines == ("--model\\s",)
    assert cfg.continuous.frequency == 49 and cfg.continuous.window_s == 5.5 and cfg.continuous.launch_stacks == 0
    assert cfg.output.dir == Path("/srv/prof") and cfg.output.formats == ("folded", "svg")
    assert cfg.retention.max_total_mb == 10 and cfg.source == "t.toml"


@pytest.mark.parametrize(("text", "message"), [
    ("[watch", "not valid TOML"),
    ("[wach]\n", "unknown section [wach]"),
    ("[continuous]\nrate = 3\n", "unknown key 'rate' in [continuous]"),
    ("[continuous]\nfrequency = 0\n", "[continuous] frequency: 0 is out of range"),
    ("[continuous]\nfrequency = 19.5\n", "expected an integer"),
    ("[continuous]\nwindow_s = true\n", "expected a number"),
    ("[continuous]\nlaunch_stacks = -1\n", "[continuous] launch_stacks: -1 is out of range"),
    ("[watch]\ncmdlines = ['(']\n", "bad regular expression"),
    ("[watch]\nnames = 'python'\n", "expected a list of strings"),
    ("[watch]\ncgroups = ['system.slice']\n", "cgroup paths start with '/'"),
    ("[output]\ndir = 'relative/dir'\n", "expected an absolute path"),
    ("[output]\ndir = '/var/lib/../../etc'\n", "'..' is not allowed"),
    ("[output]\nformats = ['gif']\n", "unknown format 'gif'"),
    ("[control]\nsocket = 3\n", "expected an absolute path"),
    ("watch = 3\n", "[watch] must be a table"),
    ("[trigger]\ndefault_frequency = 500\nmax_frequency = 100\n", "defaults exceed the maximums"),
])
def test_malformed_files_are_one_clear_line(text: str, message: str) -> None:
    with pytest.raises(BadInput) as e:
        parse_config(text, "f.toml")
    assert message in str(e.value) and "\n" not in str(e.value)
    assert str(e.value).startswith("f.toml")


def test_unreadable_file(tmp_path: Path) -> None:
    with pytest.raises(BadInput, match="cannot read config"):
        load_config(tmp_path / "missing.toml")
    bad = tmp_path / "bin.toml"
    bad.write_bytes(b"\xff\xfe")
    with pytest.raises(BadInput, match="not UTF-8"):
        load_config(bad)


_scalars = st.one_of(st.integers(-10**6, 10**6), st.floats(allow_nan=False), st.booleans(), st.text(max_size=12),
                     st.lists(st.text(max_size=8), max_size=3))
_keys = st.sampled_from(["frequency", "window_s", "runtimes", "launch_stacks", "names", "cmdlines", "cgroups", "dir",
                         "formats", "max_age_h", "socket", "nice", "bogus"])
_sections = st.sampled_from(["watch", "continuous", "output", "retention", "trigger", "limits", "control", "x"])


def _toml_value(v: object) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return repr(v) if v == v and abs(v) != float("inf") else "0.0"
    if isinstance(v, str):
        return '"' + v.encode("unicode_escape").decode().replace('"', '\\"') + '"'
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    return str(v)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(_sections, st.dictionaries(_keys, _scalars, max_size=4), max_size=4))
def test_any_document_parses_or_fails_with_config_error(doc: dict[str, dict[str, object]]) -> None:
    text = "".join(f"[{s}]\n" + "".join(f"{k} = {_toml_value(v)}\n" for k, v in kv.items()) for s, kv in doc.items())
    try:
        tomllib.loads(text)
    except tomllib.TOMLDecodeError:
        pass
    try:
        cfg = parse_config(text)
    except BadInput as e:
        assert "\n" not in str(e)
        return
    assert 1 <= cfg.continuous.frequency <= 1000 and cfg.output.dir.is_absolute()


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=200))
def test_arbitrary_bytes(data: bytes) -> None:
    try:
        parse_config(data.decode(errors="replace"))
    except BadInput:
        pass

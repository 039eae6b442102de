"""pprof files read with Google's own schema, never aiflame's exporters/pprof.proto: profile.proto of
github.com/google/pprof as Debian ships it (golang-github-google-pprof-dev, installed by `make setup`), compiled
here by protoc and decoded by protobuf. `check_valid` applies what pprof's reader refuses (profile/encode.go's
string table check and profile/profile.go's CheckValid), so a file that passes is one `go tool pprof` opens."""

from __future__ import annotations

import functools
import gzip
import importlib.util
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

__all__ = ["PROFILE_PROTO", "check_valid", "read_pprof"]

PROFILE_PROTO = Path("/usr/share/gocode/src/github.com/google/pprof/proto/profile.proto")
_keep: list[tempfile.TemporaryDirectory[str]] = []


@functools.cache
def _schema() -> Any:
    """The module protoc generates from Google's profile.proto (package perftools.profiles)."""
    if not PROFILE_PROTO.is_file():
        pytest.fail(f"{PROFILE_PROTO} missing: `make setup` installs golang-github-google-pprof-dev")
    tmp = tempfile.TemporaryDirectory(prefix="aiflame-pprof-proto-")  # removed when the session ends
    _keep.append(tmp)
    out = Path(tmp.name)
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", f"-I{PROFILE_PROTO.parent}", f"--python_out={out}",
                    str(PROFILE_PROTO)], check=True, capture_output=True)
    spec = importlib.util.spec_from_file_location("google_pprof_profile_pb2", out / "profile_pb2.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def check_valid(p: Any) -> None:
    """pprof's own rules for a profile it will read: string_table[0] is "" and every string index is in it; each
    sample has one value per sample type; mapping, function and location ids are non-zero and unique, and every
    id a sample, location or line names exists."""
    strings = len(p.string_table)
    assert strings and p.string_table[0] == "", "string_table[0] must be ''"
    indices = [*p.comment, p.drop_frames, p.keep_frames, p.default_sample_type, p.period_type.type,
               p.period_type.unit, *(i for t in p.sample_type for i in (t.type, t.unit)),
               *(i for s in p.sample for lab in s.label for i in (lab.key, lab.str, lab.num_unit)),
               *(i for m in p.mapping for i in (m.filename, m.build_id)),
               *(i for f in p.function for i in (f.name, f.system_name, f.filename))]
    assert all(0 <= i < strings for i in indices), "string index out of range"
    assert p.sample_type or not p.sample, "missing sample type information"
    for kind, table in (("mapping", p.mapping), ("function", p.function), ("location", p.location)):
        ids = [x.id for x in table]
        assert 0 not in ids and len(set(ids)) == len(ids), f"{kind} ids must be non-zero and unique: {ids}"
    mappings, functions = {m.id for m in p.mapping}, {f.id for f in p.function}
    locations = {loc.id for loc in p.location}
    for loc in p.location:
        assert loc.mapping_id == 0 or loc.mapping_id in mappings, f"location {loc.id}: no mapping {loc.mapping_id}"
        assert all(ln.function_id in functions for ln in loc.line), f"location {loc.id}: a line's function is missing"
    for s in p.sample:
        assert len(s.value) == len(p.sample_type), "a sample's values do not match the sample types"
        assert all(i in locations for i in s.location_id), "a sample names a missing location"


def read_pprof(data: bytes) -> Any:
    """A gzipped (or plain) pprof file decoded with Google's schema and checked as pprof checks it."""
    if data[:2] == b"\x1f\x8b":
        data = gzip.decompress(data)
    p = _schema().Profile()
    p.ParseFromString(data)
    check_valid(p)
    return p

"""The CUPTI injection library's stream: its C serializer (fed real CUPTI structs by a driver compiled against
the wheel's headers) and symbolize/cupti_stream.py must agree on every field; the reader must meet cut,
malformed and foreign input with a clear message; streams become RawStallSample and GpuCode records.

Past 400 lines by one `Oracle:` line per truth check (issue #30), kept in one file with its fixtures."""

from __future__ import annotations

import hashlib
import json
import os
import struct
import subprocess
from collections.abc import Iterable
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aiflame.agent.accel.cupti_build import INJECT_SOURCE, CuptiInstall, build_injection
from aiflame.core.errors import Unreadable
from aiflame.symbolize.vendor.cupti_stream import MAGIC, RecordType, parse_stream, reason_counts, stalls_from_stream
from tests.conftest import PROGRAMS


@pytest.fixture(scope="module")
def driver(cupti: CuptiInstall, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tests/programs/cupti_stream_driver.c linked against the injection library built as the agent builds it."""
    d = tmp_path_factory.mktemp("cupti")
    lib = build_injection(cupti, cache_dir=d / "cache")
    exe = d / "driver"
    subprocess.run(["cc", "-Wall", "-Werror", "-I", str(cupti.include), "-o", str(exe),
                    str(PROGRAMS / "cupti_stream_driver.c"), str(lib), f"-Wl,-rpath,{lib.parent}"],
                   check=True, capture_output=True, text=True)
    return exe


def _run_driver(driver: Path, out: Path, seed: int) -> dict[str, object]:
    proc = subprocess.run([str(driver), str(out), str(seed)], check=True, capture_output=True, text=True)
    return json.loads(proc.stdout)  # type: ignore[no-any-return]


@pytest.mark.parametrize("seed", [1, 2, 3, 7, 1234])
def test_c_serializer_and_reader_agree_on_cupti_structs(driver: Path, tmp_path: Path, seed: int) -> None:
    # Oracle: by construction — the driver fills CUPTI's own structs (its headers) and prints them
    path = tmp_path / "s.stream"
    want = _run_driver(driver, path, seed)
    s = parse_stream(path.read_bytes(), path.name)
    assert s.complete and not s.problems
    assert s.pid > 0 and s.start_ns > 0
    assert s.info == {"cupti_api_version": "130005"}
    ctx = want["ctx"]
    assert s.devices == {ctx: want["device"]}
    assert s.reasons == {ctx: {i: n for i, n in want["reasons"]}}  # type: ignore[attr-defined]
    cub = want["cubin"]
    assert isinstance(cub, dict)
    assert [(c.ctx, c.module_id, c.crc, c.data) for c in s.cubins] == [
        (ctx, cub["module_id"], cub["crc"], bytes.fromhex(cub["hex"]))]
    batch = want["batch"]
    assert isinstance(batch, dict)
    (b,) = s.batches
    assert (b.ctx, b.time_ns, b.range_id, b.total_samples, b.dropped_samples, b.non_user_samples,
            b.hardware_buffer_full, b.remaining_pcs, b.from_config_buffer) == (
        ctx, batch["time_ns"], batch["range_id"], batch["total_samples"], batch["dropped_samples"],
        batch["non_user_samples"], bool(batch["hardware_buffer_full"]), batch["remaining_pcs"], True)
    got = [{"crc": p.crc, "pc_offset": p.pc_offset, "function_index": p.function_index,
            "correlation_id": p.correlation_id, "function": p.function, "reasons": [list(r) for r in p.reasons]}
           for p in b.pcs]
    assert got == batch["pcs"]
    assert [(e.stage, e.code, e.message) for e in s.errors] == [
        ("cuptiPCSamplingEnable", 17, "CUPTI_ERROR_NOT_SUPPORTED")]
    assert s.counters["cupti_dropped_samples"] == batch["dropped_samples"]
    assert s.counters["samples_dropped"] == 0


def test_stream_to_stall_samples_and_cubins(driver: Path, tmp_path: Path) -> None:
    # Oracle: by construction — the driver's printed CUPTI records; hashlib's sha256 of the cubin
    path = tmp_path / "s.stream"
    want = _run_driver(driver, path, 5)
    s = parse_stream(path.read_bytes())
    samples, code, counts = stalls_from_stream(s)
    cub = want["cubin"]
    assert isinstance(cub, dict)
    data = bytes.fromhex(cub["hex"])
    assert [(c.digest, c.kind, c.data) for c in code] == [(hashlib.sha256(data).hexdigest(), "cubin", data)]
    batch = want["batch"]
    assert isinstance(batch, dict)
    names = dict(want["reasons"])  # type: ignore[call-overload]
    expected = []
    for pc in batch["pcs"]:
        digest = code[0].digest if pc["crc"] == cub["crc"] else ""
        for idx, n in pc["reasons"]:
            if n:
                expected.append((s.pid, want["device"], digest, pc["function"], pc["pc_offset"], names[idx], n,
                                 pc["correlation_id"], batch["time_ns"]))
    assert [(x.pid, x.device, x.code, x.kernel, x.offset, x.reason, x.count, x.correlation_id, x.time_ns)
            for x in samples] == expected
    assert all(x.source == "cupti" for x in samples)
    assert counts["cupti_samples"] == sum(e[6] for e in expected)
    assert counts["cupti_samples_without_cubin"] == sum(e[6] for e in expected if not e[2])


# A test-side writer of the same format, for the cases the C side never produces (malformed, foreign input).

def _str(s: str) -> bytes:
    b = s.encode()
    return struct.pack("<H", len(b)) + b


def _rec(rtype: int, payload: bytes) -> bytes:
    return struct.pack("<HHI", rtype, 0, len(payload)) + payload


def _header(pid: int = 42, version: int = 1) -> bytes:
    return struct.pack("<8sHHIQ", MAGIC, version, 24, pid, 1000)


def _pcs(ctx: int, pcs: list[tuple[int, int, str, list[tuple[int, int]]]]) -> bytes:
    out = struct.pack("<IIQQQQQBBHI", ctx, len(pcs), 5, 0, 0, 0, 0, 0, 0, 0, 0)
    for crc, off, name, reasons in pcs:
        out += struct.pack("<QQIII", crc, off, 0, 0, len(reasons)) + _str(name)
        out += b"".join(struct.pack("<II", i, n) for i, n in reasons)
    return out


def _sample_stream() -> bytes:
    reasons = struct.pack("<II", 1, 2) + struct.pack("<I", 0) + _str("stalled_a") + struct.pack("<I", 4) + _str("b")
    return (_header() + _rec(RecordType.CONTEXT, struct.pack("<IIQ", 1, 0, 9))
            + _rec(RecordType.REASONS, reasons)
            + _rec(RecordType.CUBIN, struct.pack("<IIQQ", 1, 2, 77, 3) + b"abc")
            + _rec(RecordType.PCS, _pcs(1, [(77, 0x40, "_Z1kv", [(0, 3), (4, 0), (9, 2)]), (99, 0x10, "_Z1jv",
                                                                                          [(4, 1)])]))
            + _rec(RecordType.COUNTERS, struct.pack("<I", 1) + _str("samples_dropped") + struct.pack("<Q", 6))
            + _rec(RecordType.END, b""))


def test_unknown_reason_and_missing_cubin_are_kept_and_counted() -> None:
    # Oracle: by construction — a stream written here by a test-side writer of the format
    s = parse_stream(_sample_stream())
    samples, code, counts = stalls_from_stream(s)
    assert [(x.code != "", x.kernel, x.offset, x.reason, x.count) for x in samples] == [
        (True, "_Z1kv", 0x40, "stalled_a", 3), (True, "_Z1kv", 0x40, "stall_reason_9", 2),
        (False, "_Z1jv", 0x10, "b", 1)]
    assert counts["cupti_unknown_reason_samples"] == 2
    assert counts["cupti_samples_without_cubin"] == 1
    assert counts["cupti_samples_dropped"] == 6
    assert code[0].digest == hashlib.sha256(b"abc").hexdigest()


@pytest.mark.parametrize(("data", "message"), [
    (b"", "too short"),
    (b"GARBAGE!" + bytes(16), "not an aiflame CUPTI stream"),
    (_header(version=2), "version 2"),
    (struct.pack("<8sHHIQ", MAGIC, 1, 4, 1, 1), "bad header size 4"),
])
def test_foreign_or_unreadable_streams_fail_with_one_line(data: bytes, message: str) -> None:
    with pytest.raises(Unreadable, match=message) as e:
        parse_stream(data, "x.stream")
    assert "\n" not in str(e.value) and str(e.value).startswith("x.stream: ")


def test_cut_stream_keeps_whole_records_and_says_so() -> None:
    full = _sample_stream()
    cut = full[:-20]  # inside the counters record
    s = parse_stream(cut, "c")
    assert not s.complete and len(s.batches) == 1 and s.cubins
    assert s.problems and "cut short" in s.problems[0]


def test_malformed_and_unknown_records_are_skipped_and_named() -> None:
    data = (_header() + _rec(RecordType.PCS, struct.pack("<I", 1)) + _rec(99, b"zz")
            + _rec(RecordType.CONTEXT, struct.pack("<IIQ", 3, 0xFFFFFFFF, 0) + b"x")
            + _rec(RecordType.CONTEXT, struct.pack("<IIQ", 4, 0xFFFFFFFF, 0)) + _rec(RecordType.END, b""))
    s = parse_stream(data, "m")
    assert s.complete and s.devices == {4: -1}
    assert len(s.problems) == 3
    assert "malformed record of type 6" in s.problems[0]
    assert "unknown record type 99" in s.problems[1]
    assert "malformed record of type 3" in s.problems[2]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_reader_never_crashes_on_mutated_streams(data: st.DataObject) -> None:
    raw = bytearray(_sample_stream())
    for _ in range(data.draw(st.integers(0, 8))):
        pos = data.draw(st.integers(0, len(raw) - 1))
        raw[pos] = data.draw(st.integers(0, 255))
    raw = raw[:data.draw(st.integers(0, len(raw)))]
    try:
        s = parse_stream(bytes(raw), "f")
    except Unreadable as e:
        assert str(e).startswith("f: ")
        return
    stalls_from_stream(s)  # whatever survived converts without error


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=400))
def test_reader_never_crashes_on_random_records(body: bytes) -> None:
    try:
        parse_stream(_header() + body, "r")
    except Unreadable as e:
        assert str(e).startswith("r: ")


def test_build_is_cached_and_rebuilt_per_key(cupti: CuptiInstall, tmp_path: Path) -> None:
    a = build_injection(cupti, cache_dir=tmp_path)
    mtime = a.stat().st_mtime_ns
    assert build_injection(cupti, cache_dir=tmp_path) == a and a.stat().st_mtime_ns == mtime
    syms = subprocess.run(["nm", "-D", "--defined-only", str(a)], capture_output=True, text=True, check=True).stdout
    assert "InitializeInjection" in syms and "aiflame_cupti_write_pcs" in syms
    # Links libc only: nothing NVIDIA's is needed to load it (libcupti is dlopened at run time).
    needed = subprocess.run(["readelf", "-d", str(a)], capture_output=True, text=True, check=True).stdout
    assert "cupti" not in needed and "libcuda" not in needed
    assert os.access(a, os.R_OK)


class _Sink:
    def __init__(self) -> None:
        self.stalls: list[object] = []

    def add_stalls(self, samples: Iterable[object]) -> None:
        self.stalls.extend(samples)

    def add_stream(self, st: object) -> None:
        self.stalls.append(st)


def test_planted_files_in_the_stream_directory_are_refused_fast(tmp_path: Path) -> None:
    """Anyone may write into the stream directory (targets drop privileges): a FIFO, /dev/zero behind a symlink
    or a huge sparse file planted there must neither hang the capture's end nor take its memory."""
    import time
    from typing import Any, cast

    from aiflame.agent.accel.cupti import CuptiCollector, CuptiOptions, StreamDir

    out = tmp_path / "out"
    out.mkdir()
    sd = StreamDir(out)
    assert oct(os.stat(sd.path).st_mode & 0o7777) == "0o1733" and sd.path.name.startswith(".cupti-")
    os.mkfifo(sd.path / "cupti-1.stream")
    (sd.path / "cupti-2.stream").symlink_to("/dev/zero")
    with open(sd.path / "cupti-3.stream", "wb") as f:
        f.truncate(8 << 30)
    # A name that is no stream's (not UTF-8: it could not go into the capture), and a file that is no stream.
    os.close(os.open(os.fsencode(sd.path) + b"/cupti-\xff.stream", os.O_CREAT | os.O_WRONLY, 0o600))
    (sd.path / "cupti-4.stream").write_bytes(b"MZ" + bytes(100))
    opts = CuptiOptions(max_stream_bytes=1 << 20)
    col = CuptiCollector(cast(Any, None), tmp_path / "lib.so", sd, opts)
    sink = _Sink()
    t0 = time.monotonic()
    res = col.collect(sink)
    assert time.monotonic() - t0 < 5
    assert res.counters.get("cupti_streams_unreadable") == 5 and res.processes == 0 and sink.stalls == []
    assert any("not a regular file" in w for w in res.warnings), res.warnings
    assert any("more than the" in w for w in res.warnings), res.warnings
    assert any("cupti-\\udcff.stream" in w and "not the name of a stream" in w for w in res.warnings), res.warnings
    assert any("cupti-4.stream" in w and "bad magic" in w for w in res.warnings), res.warnings
    assert all(w.isascii() for w in res.warnings)
    assert (tmp_path / "out" / sd.name).is_dir()  # left for a look: nothing stored, nothing removed


def test_the_collector_stores_streams_whole_and_the_road_converts_them(tmp_path: Path) -> None:
    """The agent never parses what a target wrote: it stores each stream as it is; reading the capture (the road)
    converts them, warns of the bad one (kept in the capture, not lost) and counts both."""
    # Oracle: the stream's samples by construction (19 = 10 + 5 + 4 of `_not_issued_stream`), the foreign one's bytes
    from typing import Any, cast

    from aiflame.agent.accel.cupti import CuptiCollector, CuptiOptions, StreamDir
    from aiflame.core.capture import CaptureWriter, new_header, read_capture
    from aiflame.core.raw import CaptureFooter
    from aiflame.symbolize.road import read

    sd = StreamDir(tmp_path)
    good = _not_issued_stream([(0, 10), (1, 7), (2, 5), (3, 4), (4, 4)])
    (sd.path / "cupti-7.stream").write_bytes(good)
    newer = _header(version=99) + b"records of a newer format"
    (sd.path / "cupti-8.stream").write_bytes(newer)
    col = CuptiCollector(cast(Any, None), tmp_path / "lib.so", sd, CuptiOptions())
    path = tmp_path / "c.aiflame"
    w = CaptureWriter(path, new_header(99, "cpu-clock", ("aiflame",), "test", {}))
    res = col.collect(w)
    w.close(CaptureFooter(counters={"cupti_processes": res.processes}))
    assert res.processes == 2 and res.warnings == [] and not sd.path.exists()
    raw = read_capture(path)
    assert [(x.format, x.name, x.data) for x in raw.streams] == [
        ("cupti", "cupti-7.stream", good), ("cupti", "cupti-8.stream", newer)] and raw.stalls == []
    cap, warnings = read(path)
    assert sum(x.count for x in cap.stalls) == 19
    assert cap.streams == raw.streams[1:]  # the one this aiflame cannot read stays, for a newer one
    assert warnings == ["cupti-8.stream: CUPTI stream version 99, this aiflame reads 1"]
    assert cap.footer is not None
    assert {k: cap.footer.counters.get(k) for k in ("cupti_processes", "cupti_samples", "cupti_streams_unreadable")
            } == {"cupti_processes": 2, "cupti_samples": 19, "cupti_streams_unreadable": 1}


def _not_issued_stream(pairs: list[tuple[int, int]]) -> bytes:
    names = [(0, "smsp__pcsamp_warps_issue_stalled_long_scoreboard"),
             (1, "smsp__pcsamp_warps_issue_stalled_long_scoreboard_not_issued"),
             (2, "smsp__pcsamp_warps_issue_stalled_selected"),
             (3, "smsp__pcsamp_warps_issue_stalled_wait"), (4, "smsp__pcsamp_warps_issue_stalled_wait_not_issued")]
    table = struct.pack("<II", 1, len(names)) + b"".join(struct.pack("<I", i) + _str(n) for i, n in names)
    return (_header() + _rec(RecordType.CONTEXT, struct.pack("<IIQ", 1, 0, 9)) + _rec(RecordType.REASONS, table)
            + _rec(RecordType.PCS, _pcs(1, [(77, 0x40, "_Z1kv", pairs)])) + _rec(RecordType.END, b""))


def test_not_issued_is_a_subset_of_its_reason_not_extra_samples() -> None:
    """CUPTI: `<reason>_not_issued` counts those of `<reason>`'s samples in which no instruction issued. The H200's
    mlp summary read long_scoreboard 28 %, long_scoreboard_not_issued 26 %: the same samples counted twice."""
    # Oracle: CUPTI's documentation of `_not_issued` (a subset of its reason); counts by construction
    s = parse_stream(_not_issued_stream([(0, 10), (1, 7), (2, 5), (3, 4), (4, 4)]))
    samples, _code, counts = stalls_from_stream(s)
    got = [(x.reason.rsplit("_stalled_", 1)[1], x.count, x.not_issued) for x in samples]
    assert got == [("long_scoreboard", 3, False), ("long_scoreboard", 7, True), ("selected", 5, False),
                   ("wait", 4, True)]
    assert counts["cupti_samples"] == 19 == 10 + 5 + 4
    assert counts["cupti_not_issued_samples"] == 11 and not counts["cupti_not_issued_over_reason"]


def test_not_issued_above_or_without_its_reason_counts_once_and_is_counted() -> None:
    # Oracle: CUPTI's documentation of `_not_issued`; counts by construction
    s = parse_stream(_not_issued_stream([(0, 2), (1, 5), (4, 3)]))
    samples, _code, counts = stalls_from_stream(s)
    assert [(x.reason.rsplit("_stalled_", 1)[1], x.count, x.not_issued) for x in samples] == [
        ("long_scoreboard", 5, True), ("wait", 3, True)]
    assert counts["cupti_not_issued_over_reason"] == 3 + 3 and counts["cupti_samples"] == 8


@given(st.lists(st.tuples(st.integers(0, 5), st.integers(0, 1000)), max_size=12))
def test_reason_counts_never_add_samples(pairs: list[tuple[int, int]]) -> None:
    """Whatever CUPTI reports, the samples kept are each reason's count (or its not-issued count, when larger):
    never the two added."""
    # Oracle: CUPTI's documentation of `_not_issued`: the sum worked out here for each random input
    from collections import Counter

    table = {0: "a", 1: "a_not_issued", 2: "b", 3: "b_not_issued", 4: "c_not_issued"}
    out = reason_counts(pairs, table, Counter())
    per: Counter[str] = Counter()
    for idx, n in pairs:
        per[table.get(idx, f"stall_reason_{idx}")] += n
    want = max(per["a"], per["a_not_issued"]) + max(per["b"], per["b_not_issued"]) + per["c_not_issued"] \
        + per["stall_reason_5"]
    assert sum(n for _r, n, _ni in out) == want
    assert all(n > 0 for _r, n, _ni in out)
    assert {r for r, _n, ni in out if ni} <= {"a", "b"}


REAL = Path(__file__).resolve().parent.parent / "data" / "cupti" / "h100-two_kernels.stream"


def test_a_real_h100_stream_counts_each_sample_once() -> None:
    """On the real stream (tests/data/cupti/README.md) CUPTI's own batch total equals the samples of the plain
    reasons: the `_not_issued` counts are extra, a subset of their reason's, and must not be added."""
    # Oracle: CUPTI's own batch totals in a stream recorded on an H100 (tests/data/cupti/README.md)
    s = parse_stream(REAL.read_bytes(), REAL.name)
    assert s.complete and not s.problems and not s.errors and s.info["state"] == "subscribed"
    (table,) = s.reasons.values()
    assert len(table) == 40 and "smsp__pcsamp_warps_issue_stalled_long_scoreboard_not_issued" in table.values()
    subsets = 0
    for b in s.batches:
        for pc in b.pcs:
            per = {table[i]: n for i, n in pc.reasons}
            for name, n in per.items():
                if name.endswith("_not_issued"):
                    assert n <= per.get(name.removesuffix("_not_issued"), 0)
                    subsets += 1
    assert subsets > 20
    samples, code, counts = stalls_from_stream(s)
    assert counts["cupti_samples"] == sum(b.total_samples for b in s.batches) == 12954
    assert sum(x.count for x in samples) == 12954 and counts["cupti_not_issued_samples"] == 2209
    assert {x.kernel for x in samples} == {"_Z11stream_axpyPK6float4PS_fm", "_Z9fma_chainPfi"}
    assert len(code) == 1 and code[0].arch == 90 and all(x.code == code[0].digest for x in samples)


def test_batches_are_summed_per_instruction_reason_and_launch() -> None:
    """CUPTI hands the same hot PCs over in every batch: a stream keeps one sample record per instruction,
    reason, not-issued part and launch, with the first batch's time, and the totals unchanged."""
    # Oracle: by construction — two batches written here with the same hot PC
    reasons = struct.pack("<II", 1, 2) + struct.pack("<I", 0) + _str("wait") + struct.pack("<I", 1) + _str(
        "wait_not_issued")

    def batch(t: int, pcs: list[tuple[int, int, str, list[tuple[int, int]]]]) -> bytes:
        return _rec(RecordType.PCS, struct.pack("<IIQ", 1, len(pcs), t) + _pcs(1, pcs)[16:])

    data = (_header() + _rec(RecordType.CONTEXT, struct.pack("<IIQ", 1, 3, 9)) + _rec(RecordType.REASONS, reasons)
            + batch(100, [(77, 0x40, "_Z1kv", [(0, 3), (1, 1)]), (77, 0x50, "_Z1kv", [(0, 1)])])
            + batch(200, [(77, 0x40, "_Z1kv", [(0, 2), (1, 2)])]) + _rec(RecordType.END, b""))
    samples, _code, counts = stalls_from_stream(parse_stream(data))
    assert [(x.offset, x.count, x.not_issued, x.time_ns, x.device) for x in samples] == [
        (0x40, 2, False, 100, 3), (0x40, 3, True, 100, 3), (0x50, 1, False, 100, 3)]
    assert counts["cupti_samples"] == 6


def _sums(drains: list[dict[str, object]]) -> tuple[dict[tuple[int, int, int, int], dict[int, int]], dict[str, int]]:
    """What the drains handed over, summed as the library must: per (crc, offset, function, correlation id), per
    reason; and the batch fields."""
    per: dict[tuple[int, int, int, int], dict[int, int]] = {}
    batch = {"total": 0, "dropped": 0, "non_user": 0, "full": 0}
    for d in drains:
        for k in batch:
            v = d[k]
            assert isinstance(v, int)
            batch[k] = batch[k] | v if k == "full" else batch[k] + v
        pcs = d["pcs"]
        assert isinstance(pcs, list)
        for pc in pcs:
            reasons = per.setdefault((pc["crc"], pc["off"], pc["fidx"], pc["corr"]), {})
            for idx, n in pc["reasons"]:
                reasons[idx] = reasons.get(idx, 0) + n
    return per, batch


@pytest.mark.parametrize(("seed", "pool", "max_pcs"), [(1, 40, 12), (5, 40, 12), (42, 30000, 2000)])
def test_the_library_sums_drains_into_one_record(cupti: CuptiInstall, tmp_path: Path, seed: int, pool: int,
                                                 max_pcs: int) -> None:
    """CUPTI hands the same hot PCs over at every 100 ms drain; the library sums them and writes one PCS record a
    flush (on the H100 the per-drain records reached 8.5 MB/s). The record holds each (crc, offset, function,
    launch) once with every reason's samples summed, the batch fields summed, nothing lost or added; a table
    that fills (30,000 PCs) is written out first and the records still sum to the same. Built with
    AddressSanitizer and UBSan: the accumulator runs inside the user's training job."""
    # Oracle: by construction — the driver prints every drain it fed the library; summed here
    exe = tmp_path / "acc"
    subprocess.run(["cc", "-g", "-fsanitize=address,undefined", "-fno-sanitize-recover=all", "-I",
                    str(cupti.include), "-o", str(exe), str(PROGRAMS / "cupti_acc_driver.c"),
                    str(INJECT_SOURCE), "-ldl", "-lpthread"], check=True, capture_output=True, text=True)
    out = tmp_path / "s.stream"
    proc = subprocess.run([str(exe), str(out), str(seed), "30", str(pool), str(max_pcs)], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    want, batch = _sums(json.loads(proc.stdout))
    s = parse_stream(out.read_bytes())
    assert s.complete and not s.problems
    got: dict[tuple[int, int, int, int], dict[int, int]] = {}
    for b in s.batches:
        keys = [(p.crc, p.pc_offset, p.function_index, p.correlation_id) for p in b.pcs]
        assert len(set(keys)) == len(keys)  # once per record
        for key, p in zip(keys, b.pcs, strict=True):
            r = got.setdefault(key, {})
            for idx, n in p.reasons:
                r[idx] = r.get(idx, 0) + n
        assert all(p.function == f"_Z6kernel{p.function_index}v" for p in b.pcs)
    assert got == want
    assert (sum(b.total_samples for b in s.batches), sum(b.dropped_samples for b in s.batches),
            sum(b.non_user_samples for b in s.batches), max(int(b.hardware_buffer_full) for b in s.batches)) == (
        batch["total"], batch["dropped"], batch["non_user"], batch["full"])
    assert s.batches[0].time_ns == 1000  # the first drain's time
    assert (len(s.batches) == 1) == (pool < 1000)  # 30 drains, one record, unless the table filled


def test_import_keeps_the_streams_it_cannot_convert(tmp_path: Path) -> None:
    """`aiflame import` rewrites the capture with the stored streams converted: one this aiflame cannot read
    is kept as it is, not dropped with the rewrite."""
    # Oracle: the stream's samples by construction (19 of `_not_issued_stream`), the kept stream's bytes
    from aiflame.core.capture import new_header, read_capture, write_capture
    from aiflame.core.raw import Capture, CaptureFooter, RawStream
    from aiflame.symbolize.vendor.stall_import import import_records

    newer = RawStream("cupti", "cupti-8.stream", _header(version=99) + b"later")
    stored = RawStream("cupti", "cupti-7.stream", _not_issued_stream([(0, 10), (1, 7), (2, 5), (3, 4), (4, 4)]))
    path = tmp_path / "c.aiflame"
    write_capture(path, Capture(new_header(99, "cpu-clock", ("aiflame",), "t", {}), footer=CaptureFooter(),
                                streams=[stored, newer]))
    records = tmp_path / "cupti-9.stream"
    records.write_bytes(_not_issued_stream([(2, 3)]))
    import_records(path, [records], "cupti", output=tmp_path / "out.aiflame")
    out = read_capture(tmp_path / "out.aiflame")
    assert out.streams == [newer] and sum(s.count for s in out.stalls) == 19 + 3

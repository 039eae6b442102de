"""Capture file: round trip, and every kind of bad file gives one Unreadable line."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aiflame import __version__
from aiflame.core.capture import (
    FORMAT_VERSION,
    MAGIC,
    STALL_BATCH,
    CaptureWriter,
    is_capture,
    new_header,
    read_capture,
    write_capture,
)
from aiflame.core.errors import Refused, Unreadable
from aiflame.core.raw import (
    Capture,
    CaptureFooter,
    CaptureHeader,
    CodeInfo,
    Mapping,
    ProcessSnapshot,
    PyCode,
    PyRuntimeInfo,
    RawPyFrame,
    RawSample,
    RawStallSample,
)

addr = st.integers(min_value=0, max_value=2**64 - 1)
samples = st.builds(
    RawSample,
    time_ns=st.integers(0, 2**63), pid=st.integers(0, 2**31), tid=st.integers(0, 2**31),
    cpu=st.integers(0, 1024), comm=st.text(max_size=15), user=st.tuples(*[addr] * 3) | st.just(()),
    kern=st.lists(addr, max_size=5).map(tuple), user_err=st.integers(-200, 0), kern_err=st.integers(-200, 0),
    weight=st.integers(1, 1000),
    py=st.lists(st.builds(RawPyFrame, addr, st.integers(0, 2**32 - 1), st.integers(0, 255), st.integers(0, 1)),
                max_size=4).map(tuple),
    py_flags=st.integers(0, 15), off_cpu_ns=st.integers(0, 2**64 - 1),
)


def _capture(samples: list[RawSample]) -> Capture:
    return Capture(
        CaptureHeader(1, "0.1.0", "host", "6.18", "x86_64", 99, "cpu-clock", 1, 2, ["aiflame", "profile"], "pid 1",
                      {"k": "v"}),
        samples,
        [ProcessSnapshot(7, 5, [Mapping(0x1000, 0x2000, 0, "/bin/x", "abcd", "r-xp")], 1, "x", ["x", "-y"], "/bin/x",
                         2)],
        {0xFFFF0000: "do_sys_read"},
        [PyCode(7, 0x7000, 5, CodeInfo("Cls.method", "/x.py", 3, b"\x01\x02", (3, 12), 192))],
        [PyRuntimeInfo(7, "3.12.1", "dwarf:/lib/libpython3.12.so", "/lib/libpython3.12.so")],
        footer=CaptureFooter(10, 20, 0, {"lost": 3}, "duration", 0.25),
    )


@settings(max_examples=50, deadline=None)
@given(st.lists(samples, max_size=20))
def test_round_trip(tmp_path_factory: pytest.TempPathFactory, ss: list[RawSample]) -> None:
    path = tmp_path_factory.mktemp("cap") / "c.aiflame"
    cap = _capture(ss)
    write_capture(path, cap)
    back = read_capture(path)
    assert back.header == cap.header
    assert back.samples == ss
    assert back.processes == cap.processes
    assert back.kernel_symbols == cap.kernel_symbols
    assert back.py_codes == cap.py_codes and back.py_runtimes == cap.py_runtimes
    assert back.footer is not None and back.footer.counters == {"lost": 3}
    assert back.footer.samples == len(ss) and back.footer.stop_reason == "duration"


def test_partial_file_is_renamed_on_close(tmp_path: Path) -> None:
    path = tmp_path / "c.aiflame"
    w = CaptureWriter(path, _capture([]).header)
    assert not path.exists() and (tmp_path / "c.aiflame.partial").exists()
    w.close(CaptureFooter())
    assert path.exists() and not (tmp_path / "c.aiflame.partial").exists()


def test_missing_and_foreign_files(tmp_path: Path) -> None:
    with pytest.raises(Unreadable, match="No such file"):
        read_capture(tmp_path / "nope")
    (tmp_path / "f").write_bytes(b"\x7fELF....")
    with pytest.raises(Unreadable, match="not an aiflame capture"):
        read_capture(tmp_path / "f")
    with pytest.raises(Unreadable, match="is a directory"):
        read_capture(tmp_path)


def test_new_header_and_is_capture(tmp_path: Path) -> None:
    h = new_header(99, "cpu-clock", ("aiflame", "profile"), "pid 7", {"aiflame.mode": "daemon"})
    assert (h.format_version, h.aiflame_version, h.argv, h.target) == (FORMAT_VERSION, __version__,
                                                                        ["aiflame", "profile"], "pid 7")
    assert h.host and h.kernel and h.machine and h.start_wall_ns > 0 and h.start_mono_ns > 0
    path = tmp_path / "c.aiflame"
    write_capture(path, Capture(h, footer=CaptureFooter()))
    assert is_capture(path) and read_capture(path).header == h
    (tmp_path / "f").write_bytes(b"a;b 1\n")
    assert not is_capture(tmp_path / "f")
    with pytest.raises(Unreadable, match="No such file"):
        is_capture(tmp_path / "nope")


def test_truncated_file(tmp_path: Path) -> None:
    path = tmp_path / "c.aiflame"
    write_capture(path, _capture([RawSample(1, 2, 3, 0, "a", (1, 2), ())] * 10))
    data = path.read_bytes()
    for cut in (len(MAGIC) + 3, len(data) // 2, len(data) - 1):
        (tmp_path / "t").write_bytes(data[:cut])
        with pytest.raises(Unreadable, match="truncated|corrupt"):
            read_capture(tmp_path / "t")


def test_newer_format_is_refused(tmp_path: Path) -> None:
    cap = _capture([])
    cap.header.format_version = 99
    write_capture(tmp_path / "c", cap)
    with pytest.raises(Unreadable, match="newer"):
        read_capture(tmp_path / "c")


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=400), st.integers(0, 400), st.integers(0, 255))
def test_fuzzed_files_give_capture_errors(tmp_path_factory: pytest.TempPathFactory, junk: bytes, pos: int,
                                          byte: int) -> None:
    d = tmp_path_factory.mktemp("fz")
    good = d / "good"
    write_capture(good, _capture([RawSample(1, 2, 3, 0, "a", (1, 2), (5,))] * 3))
    data = bytearray(good.read_bytes())
    data[pos % len(data)] = byte
    for blob in (bytes(data), MAGIC + junk, bytes(data[: pos % len(data)]) + junk):
        (d / "bad").write_bytes(blob)
        try:
            read_capture(d / "bad")
        except Unreadable as e:
            assert "\n" not in str(e)


stall_samples = st.builds(
    RawStallSample,
    source=st.sampled_from(["cupti", "xe", "rocprof"]), pid=st.integers(0, 2**32 - 1), device=st.integers(-1, 64),
    code=st.text(max_size=64), kernel=st.text(max_size=40), offset=st.integers(0, 2**64 - 1),
    reason=st.text(max_size=60), count=st.integers(0, 2**64 - 1), correlation_id=st.integers(0, 2**64 - 1),
    time_ns=st.integers(0, 2**64 - 1), not_issued=st.booleans(),
)


@settings(max_examples=50, deadline=None)
@given(st.lists(stall_samples, max_size=30))
def test_stalls_round_trip(tmp_path_factory: pytest.TempPathFactory, stalls: list[RawStallSample]) -> None:
    path = tmp_path_factory.mktemp("cap") / "c.aiflame"
    cap = _capture([])
    cap.stalls = stalls
    write_capture(path, cap)
    assert read_capture(path).stalls == stalls


def test_stalls_are_batched_and_keep_order(tmp_path: Path) -> None:
    path = tmp_path / "c.aiflame"
    w = CaptureWriter(path, _capture([]).header)
    n = STALL_BATCH + 7
    ss = [RawStallSample("xe", 0, 0, "", "", i * 8, "sbid", 1 + i % 3) for i in range(n)]
    w.add_stalls(ss[:5])
    w.add_stalls(iter(ss[5:]))
    w.add_stalls([])
    w.close(CaptureFooter())
    assert w.stalls_written == n
    assert read_capture(path).stalls == ss


def _cut_capture(tmp_path: Path, n: int) -> tuple[Path, bytes]:
    """A capture of `n` samples whose writer was killed: no footer, the last record cut in half."""
    ss = [RawSample(1000 + i, 7, 7, 0, "x", (0x1100,), (), 0, 0) for i in range(n)]
    path = tmp_path / "c.aiflame"
    write_capture(path, _capture(ss))
    data = path.read_bytes()
    path.unlink()
    partial = tmp_path / "c.aiflame.partial"
    partial.write_bytes(data[: len(data) * 3 // 4])  # well before the footer, inside some sample record
    return partial, data


def test_a_capture_cut_short_is_recovered(tmp_path: Path) -> None:
    from aiflame.core.capture import recover_capture

    partial, whole = _cut_capture(tmp_path, 200)
    with pytest.raises(Unreadable, match="aiflame recover"):
        read_capture(partial)
    cap = read_capture(partial, partial=True)
    assert cap.footer is None and 0 < len(cap.samples) < 200 and cap.processes
    out = tmp_path / "c.aiflame"
    back = recover_capture(partial, out)
    again = read_capture(out)
    assert again.footer is not None and again.footer.stop_reason == "recovered"
    assert again.footer.counters == {"recovered": 1} and again.samples == back.samples == cap.samples
    assert again.footer.end_mono_ns == cap.samples[-1].time_ns
    assert not list(tmp_path.glob(".*recovering*"))
    (tmp_path / "junk").write_bytes(b"junk")
    with pytest.raises(Unreadable, match="bad magic"):
        recover_capture(tmp_path / "junk", tmp_path / "j.aiflame")


def test_recover_command(tmp_path: Path) -> None:
    from aiflame.cli.main import main

    partial, _ = _cut_capture(tmp_path, 50)
    assert main(["recover", str(partial)]) == 0
    assert read_capture(tmp_path / "c.aiflame").footer is not None
    assert main(["export", str(tmp_path / "c.aiflame"), "--format", "folded", "-o", str(tmp_path / "c.folded")]) == 0
    assert (tmp_path / "c.folded").stat().st_size > 0


def test_writer_replaces_a_planted_partial_symlink(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_bytes(b"root's")
    out = tmp_path / "out"
    out.mkdir()
    (out / "c.aiflame.partial").symlink_to(victim)
    w = CaptureWriter(out / "c.aiflame", _capture([]).header)
    w.close(CaptureFooter())
    assert victim.read_bytes() == b"root's" and read_capture(out / "c.aiflame").footer is not None


def _records_sizes(path: Path) -> list[tuple[str, int]]:
    from aiflame.core.capture import iter_records

    return [(r.WhichOneof("body") or "", r.ByteSize()) for r in iter_records(path.read_bytes(), partial=True)]


def test_a_code_object_over_the_record_limit_is_split_and_joined(tmp_path: Path) -> None:
    """The H200's torch capture: a 70 MiB module's cubin was one record over the reader's 64 MiB limit, and the
    whole capture was refused. Now it is stored in pieces under the limit and read back whole."""
    from aiflame.core.capture import MAX_RECORD
    from aiflame.core.raw import GpuCode

    big = GpuCode("d" * 64, "cubin", 90, "memory of pid 7 (CUPTI)", bytes(range(256)) * (70 << 12))
    small = GpuCode("e" * 64, "cubin", 90, "x", b"\x7fELF small")
    cap = _capture([])
    cap.gpu_code = [small, big]
    path = tmp_path / "c.aiflame"
    write_capture(path, cap)
    sizes = _records_sizes(path)
    assert max(n for _k, n in sizes) <= MAX_RECORD and sum(k == "gpu_code" for k, _n in sizes) == 1 + 5
    assert read_capture(path).gpu_code == [small, big]


def test_a_capture_cut_inside_a_split_code_object_reads_without_it(tmp_path: Path) -> None:
    from aiflame.core.capture import recover_capture
    from aiflame.core.raw import GpuCode

    cap = _capture([RawSample(5, 7, 7, 0, "x", (1,), (), 0, 0)])
    cap.gpu_code = [GpuCode("d" * 64, "cubin", 90, "o", b"x" * (40 << 20))]
    path = tmp_path / "c.aiflame"
    write_capture(path, cap)
    cut = tmp_path / "cut.aiflame.partial"
    cut.write_bytes(path.read_bytes()[: 30 << 20])
    assert read_capture(cut, partial=True).gpu_code == []
    assert recover_capture(cut, tmp_path / "r.aiflame").gpu_code == []


def test_pieces_out_of_order_are_corrupt(tmp_path: Path) -> None:
    from aiflame.core import aiflame_capture_pb2 as pb
    from aiflame.core.capture import _varint

    head = pb.Record(header=pb.Header(format_version=FORMAT_VERSION)).SerializeToString()
    rec = pb.Record(gpu_code=pb.GpuCode(digest="d", data=b"abc", size=10, offset=3)).SerializeToString()
    bad = tmp_path / "bad.aiflame"
    bad.write_bytes(MAGIC + _varint(len(head)) + head + _varint(len(rec)) + rec)
    with pytest.raises(Unreadable, match="piece out of order"):
        read_capture(bad, partial=True)


@given(st.lists(st.binary(max_size=300), max_size=4), st.integers(8, 64))
@settings(max_examples=40, deadline=None)
def test_streams_round_trip_whole_or_in_pieces(tmp_path_factory: pytest.TempPathFactory, datas: list[bytes],
                                               piece: int) -> None:
    """A vendor's stall stream (stored by the live CUPTI collector as its library wrote it) reads back byte for
    byte, in order, whether it fits one record or was split into pieces (the piece size lowered here)."""
    from aiflame.core import capture as capmod
    from aiflame.core.raw import RawStream

    cap = _capture([])
    cap.streams = [RawStream("cupti", f"cupti-{i}.stream", d) for i, d in enumerate(datas)]
    path = tmp_path_factory.mktemp("s") / "c.aiflame"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(capmod, "MAX_PIECE", piece)
        write_capture(path, cap)
    kinds = [k for k, _n in _records_sizes(path) if k == "stream"]
    assert len(kinds) == sum(max(1, -(-len(d) // piece)) for d in datas)
    assert read_capture(path).streams == cap.streams


def test_a_stream_piece_out_of_order_is_corrupt_and_a_cut_one_left_out(tmp_path: Path) -> None:
    from aiflame.core import aiflame_capture_pb2 as pb
    from aiflame.core.capture import _varint

    def records(*recs: pb.Record) -> bytes:
        head = pb.Record(header=pb.Header(format_version=FORMAT_VERSION)).SerializeToString()
        out = MAGIC + _varint(len(head)) + head
        for r in recs:
            data = r.SerializeToString()
            out += _varint(len(data)) + data
        return out

    bad = tmp_path / "bad.aiflame"
    bad.write_bytes(records(pb.Record(stream=pb.Stream(format="cupti", name="s", data=b"abc", size=10, offset=3))))
    with pytest.raises(Unreadable, match=r"stream s: a piece out of order"):
        read_capture(bad, partial=True)
    cut = tmp_path / "cut.aiflame"
    cut.write_bytes(records(pb.Record(stream=pb.Stream(format="cupti", name="s", data=b"abc", size=10))))
    assert read_capture(cut, partial=True).streams == []


def test_an_oversize_record_of_an_older_writer_is_refused_with_the_fix_and_recovered(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Captures written before the split hold a record over the limit: reading names `aiflame recover`, which
    takes it and rewrites the capture in pieces (the limit lowered here so that the test stays small)."""
    from aiflame.core import capture as capmod
    from aiflame.core.raw import GpuCode

    code = GpuCode("d" * 64, "cubin", 90, "o", bytes(range(256)) * 64)
    cap = _capture([RawSample(5, 7, 7, 0, "x", (1,), (), 0, 0)])
    cap.gpu_code = [code]
    path = tmp_path / "old.aiflame"
    write_capture(path, cap)  # one whole record of 16 KiB: what an old writer did with 70 MiB
    monkeypatch.setattr(capmod, "MAX_RECORD", 8 << 10)
    monkeypatch.setattr(capmod, "MAX_PIECE", 4 << 10)
    with pytest.raises(Unreadable, match=r"record \d+ is \d+ bytes, over .*aiflame recover"):
        read_capture(path)
    out = tmp_path / "new.aiflame"
    capmod.recover_capture(path, out)
    again = read_capture(out)
    assert again.gpu_code == [code] and again.samples == cap.samples
    assert max(n for _k, n in _records_sizes(out)) <= 8 << 10


def test_writer_refuses_a_record_over_the_limit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from aiflame.core import capture as capmod

    monkeypatch.setattr(capmod, "MAX_RECORD", 1 << 10)
    w = CaptureWriter(tmp_path / "c.aiflame", _capture([]).header)
    with pytest.raises(Refused, match="kernel_symbols record of .* bytes passes"):
        w.add_kernel_symbols({i: "x" * 20 for i in range(100)})


def test_stall_batches_end_at_a_byte_budget(tmp_path: Path) -> None:
    """Kernel names of templated torch kernels run to kilobytes: a batch ends by size as well as by count."""
    from aiflame.core.capture import STALL_BATCH_BYTES

    name = "_Z" + "x" * 4000
    ss = [RawStallSample("cupti", 7, 0, "d" * 64, name, i * 16, "wait", 1) for i in range(3000)]
    path = tmp_path / "c.aiflame"
    cap = _capture([])
    cap.stalls = ss
    write_capture(path, cap)
    sizes = [n for k, n in _records_sizes(path) if k == "stalls"]
    assert len(sizes) >= 2 and max(sizes) <= STALL_BATCH_BYTES + 8192
    assert read_capture(path).stalls == ss

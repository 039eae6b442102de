"""`aiflame import` (issue #28): a records file of another kind than its --format is refused in one line before
anything is written; a file of the right kind without samples is imported and said to be empty; the inputs are
never replaced unless --in-place asks."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from aiflame.cli.main import main
from aiflame.core.capture import read_capture, write_capture
from aiflame.core.raw import RawSample
from aiflame.symbolize.vendor.cupti_stream import RecordType
from tests.unit.test_capture import _capture
from tests.unit.test_cupti_stream import _header, _rec
from tests.unit.test_rocprof_pc import stochastic
from tests.unit.test_xe_eu_stall import record


@pytest.fixture
def capture(tmp_path: Path) -> Path:
    path = tmp_path / "profile.aiflame"
    write_capture(path, _capture([RawSample(i, 7, 7, 0, "x", (0x1100,), ()) for i in range(5)]))
    return path


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _refused(capsys: pytest.CaptureFixture[str], argv: list[str], *parts: str, code: int = 1) -> None:
    assert main(argv) == code
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("aiflame: error: ") and err.count("\n") == 1, err
    for p in parts:
        assert p in err, err


def _files(tmp_path: Path, capture: Path) -> dict[str, Path]:
    files = {"empty": b"", "text": b"gpu0 sbid 5\nhello\n", "elf": Path("/bin/true").read_bytes(),
             "capture": capture.read_bytes(), "cupti": _header(7) + _rec(RecordType.END, b"")}
    out = {}
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
        out[name] = tmp_path / name
    return out


@pytest.mark.parametrize(("fmt", "extra", "name", "says"), [
    ("xe", ["--platform", "xe2"], "elf", "an ELF file, not Xe EU stall records"),
    ("xe", ["--platform", "xe2"], "empty", "empty file, not Xe EU stall records"),
    ("xe", ["--platform", "xe2"], "text", "a text file, not Xe EU stall records"),
    ("xe", ["--platform", "xe2"], "capture", "an aiflame capture (--format capture), not Xe EU stall records"),
    ("xe", ["--platform", "pvc"], "cupti", "a CUPTI stream (--format cupti), not Xe EU stall records"),
    ("rocprof", [], "elf", "an ELF file, not rocprofiler PC-sampling records"),
    ("rocprof", [], "empty", "empty file, not rocprofiler PC-sampling records"),
    ("rocprof", [], "text", "a text file, not rocprofiler PC-sampling records"),
    ("cupti", [], "capture", "an aiflame capture (--format capture), not a CUPTI stream"),
    ("cupti", [], "empty", "empty file, not a CUPTI stream"),
    ("cupti", [], "text", "a text file, not a CUPTI stream"),
    ("cupti", [], "elf", "an ELF file, not a CUPTI stream"),
    ("capture", [], "cupti", "a CUPTI stream (--format cupti), not an aiflame capture"),
    ("capture", [], "text", "a text file, not an aiflame capture"),
    ("capture", [], "empty", "empty file, not an aiflame capture"),
])
def test_a_file_of_another_kind_is_refused(fmt: str, extra: list[str], name: str, says: str, capture: Path,
                                           tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _files(tmp_path, capture)[name]
    before = _digest(capture)
    _refused(capsys, ["import", str(capture), str(path), "-f", fmt, *extra], f"{path}: {says}")
    assert _digest(capture) == before and not (tmp_path / "profile.merged.aiflame").exists()


def test_xe_bytes_that_are_not_records_of_the_platform(capture: Path, tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    good = record("xe2", 0x20, {"sbid": 5})
    (tmp_path / "cut").write_bytes(good * 3 + good[:10])
    _refused(capsys, ["import", str(capture), str(tmp_path / "cut"), "-f", "xe", "--platform", "xe2"],
             "202 bytes are not whole 64-byte records (not EU stall data, or a wrong --platform / --record-size)")
    (tmp_path / "xe3p").write_bytes(record("xe3p", 1 << 40, {"sbid": 5}) * 4)  # IP bits beyond pvc's layout
    _refused(capsys, ["import", str(capture), str(tmp_path / "xe3p"), "-f", "xe", "--platform", "pvc"],
             "4 of 4 records are not pvc EU stall records")
    (tmp_path / "elf-aligned").write_bytes(b"\0" + Path("/bin/true").read_bytes()[1:64 * 100])  # no magic
    _refused(capsys, ["import", str(capture), str(tmp_path / "elf-aligned"), "-f", "xe", "--platform", "xe2"],
             "records are not xe2 EU stall records")


def test_a_code_object_must_be_an_amdgpu_elf(capture: Path, tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "pc.bin").write_bytes(stochastic(1, 0x40, 3))
    _refused(capsys, ["import", str(capture), str(tmp_path / "pc.bin"), "-f", "rocprof", "--code-object",
                      "1=/bin/true"], "/bin/true: an ELF file for machine 62, not an AMDGPU code object")
    (tmp_path / "co.txt").write_text("kernels\n")
    _refused(capsys, ["import", str(capture), str(tmp_path / "pc.bin"), "-f", "rocprof", "--code-object",
                      f"1={tmp_path / 'co.txt'}"], "a text file, not an AMDGPU code object")


def test_records_go_to_a_new_file_and_the_inputs_stay(capture: Path, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "x.bin").write_bytes(record("pvc", 0x20, {"sbid": 5}) + bytes(64))
    before = _digest(capture)
    assert main(["import", str(capture), str(tmp_path / "x.bin"), "-f", "xe", "--platform", "pvc"]) == 0
    merged = tmp_path / "profile.merged.aiflame"
    assert f"imported 5 stall samples (1 records after merging) into {merged}" in capsys.readouterr().out
    assert _digest(capture) == before and not read_capture(capture).stalls
    assert [(s.source, s.reason, s.count) for s in read_capture(merged).stalls] == [("xe", "sbid", 5)]
    # -o naming an input is refused, whichever input it is
    for given in (capture, tmp_path / "x.bin"):
        _refused(capsys, ["import", str(capture), str(tmp_path / "x.bin"), "-f", "xe", "--platform", "pvc",
                          "-o", str(given)], f"the output {given} is the input {given}", code=2)
    assert _digest(capture) == before
    # --in-place asks for it
    assert main(["import", str(capture), str(tmp_path / "x.bin"), "-f", "xe", "--platform", "pvc",
                 "--in-place"]) == 0
    assert f"into {capture}" in capsys.readouterr().out
    assert [s.count for s in read_capture(capture).stalls] == [5]
    _refused(capsys, ["import", str(capture), str(tmp_path / "x.bin"), "-f", "xe", "--platform", "pvc",
                      "--in-place", "-o", str(tmp_path / "y")], "not allowed with argument", code=2)


def test_a_file_of_the_right_kind_without_samples_is_said_to_be_empty(capture: Path, tmp_path: Path,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    files = _files(tmp_path, capture)
    (tmp_path / "pad.bin").write_bytes(bytes(128))  # hardware padding rows only
    for argv, note in (([str(files["cupti"]), "-f", "cupti"], f"{files['cupti']}: a CUPTI stream of pid 7 with no"),
                       ([str(files["capture"]), "-f", "capture"], f"{files['capture']}: a capture without stall"),
                       ([str(tmp_path / "pad.bin"), "-f", "xe", "--platform", "xe2"],
                        "pad.bin: 2 EU stall records, none with a stall counted")):
        assert main(["import", str(capture), *argv, "-o", str(tmp_path / "m.aiflame")]) == 0
        out, err = capsys.readouterr()
        assert "imported 0 stall samples" in out and err.startswith("warning: no samples: ") and note in err, err

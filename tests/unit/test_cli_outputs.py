"""Where `export` and `render` write (issue #28): `-o -` is stdout for text formats and refused in one line for
binary ones, a file's missing directory is made, a directory given as the file is refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from aiflame.cli.main import main
from aiflame.core.capture import write_capture
from aiflame.core.raw import RawSample
from tests.unit.test_capture import _capture


@pytest.fixture
def capture(tmp_path: Path) -> Path:
    path = tmp_path / "c.aiflame"
    write_capture(path, _capture([RawSample(i, 7, 7, 0, "x", (0x1100, 0x1200), ()) for i in range(12)]))
    return path


def _one_error_line(err: str, *parts: str) -> None:
    assert err.startswith("aiflame: error: ") and err.count("\n") == 1, err
    for p in parts:
        assert p in err, err


@pytest.mark.parametrize("fmt", ["folded", "speedscope", "svg", "perfetto-json"])
def test_dash_is_stdout_for_text_formats(fmt: str, capture: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                         capsysbinary: pytest.CaptureFixture[bytes]) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["export", str(capture), "-f", fmt, "-o", "-"]) == 0
    out, err = capsysbinary.readouterr()
    assert not (tmp_path / "-").exists() and b"wrote" not in out
    assert main(["export", str(capture), "-f", fmt, "-o", str(tmp_path / "file")]) == 0
    assert out == (tmp_path / "file").read_bytes()  # stdout holds exactly what the file holds
    if fmt == "folded":
        assert out.decode().splitlines() and all(line.rsplit(" ", 1)[1] == "12" for line in out.decode().splitlines())
    elif fmt in ("speedscope", "perfetto-json"):
        json.loads(out)
    else:
        assert out.startswith(b"<?xml")


def test_render_dash_is_stdout(capture: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                               capsysbinary: pytest.CaptureFixture[bytes]) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["render", str(capture), "-o", "-"]) == 0
    out, _ = capsysbinary.readouterr()
    assert out.startswith(b"<?xml") and out.rstrip().endswith(b"</svg>") and not (tmp_path / "-").exists()


@pytest.mark.parametrize(("fmt", "what"), [("pprof", "binary"), ("perfetto", "binary"), ("chakra", "several files")])
def test_dash_is_refused_for_binary_formats(fmt: str, what: str, capture: Path, tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["export", str(capture), "-f", fmt, "-o", "-"]) == 2
    out, err = capsys.readouterr()
    _one_error_line(err, f"format {fmt} is {what}: -o - (stdout) takes text formats only", "folded")
    assert out == "" and not (tmp_path / "-").exists()


def test_profile_dash_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["profile", "-o", "-", "--", "true"]) == 2
    _one_error_line(capsys.readouterr().err, "-o names the output directory")


def test_export_makes_the_outputs_directory(capture: Path, tmp_path: Path) -> None:
    out = tmp_path / "new" / "deeper" / "c.folded"
    assert main(["export", str(capture), "-f", "folded", "-o", str(out)]) == 0
    assert out.read_text().endswith(" 12\n")
    prefix = tmp_path / "traces" / "job"
    main(["export", str(capture), "-f", "chakra", "-o", str(prefix)])  # no events: an error, but after the mkdir
    assert prefix.parent.is_dir()


def test_a_directory_is_not_a_file_to_write(capture: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["export", str(capture), "-f", "svg", "-o", str(tmp_path)]) == 1
    _one_error_line(capsys.readouterr().err, f"{tmp_path} is a directory")
    assert main(["render", str(capture), "-o", str(tmp_path)]) == 1
    _one_error_line(capsys.readouterr().err, f"{tmp_path} is a directory")


def test_a_directory_that_cannot_be_made_is_one_line(capture: Path, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "plain").write_text("a file")
    assert main(["export", str(capture), "-f", "folded", "-o", str(tmp_path / "plain" / "x" / "c.folded")]) == 1
    _one_error_line(capsys.readouterr().err, f"cannot create directory {tmp_path / 'plain' / 'x'}")


def test_profile_keeps_an_earlier_capture(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for name in ("profile.aiflame", "profile.aiflame.partial"):
        (tmp_path / name).write_bytes(b"an earlier run")
        assert main(["profile", "-o", str(tmp_path), "-q", "--", "true"]) == 1
        _one_error_line(capsys.readouterr().err, f"{tmp_path} already holds a capture ({name})", "--force")
        assert (tmp_path / name).read_bytes() == b"an earlier run"
        (tmp_path / name).unlink()


def test_a_planted_link_is_not_an_earlier_capture(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Captures are regular files; a link under the name is something else, replaced safely by the writer
    (tests/integration/test_hostile.py plays that for real), so it does not stop the run."""
    from aiflame.cli.commands.profile import _check_out_dir
    from aiflame.core.errors import BadInput

    (tmp_path / "victim").write_text("root's data")
    (tmp_path / "profile.aiflame").symlink_to(tmp_path / "victim")
    _check_out_dir(tmp_path, force=False)  # no error
    (tmp_path / "profile.aiflame.partial").write_text("cut short")
    with pytest.raises(BadInput, match=r"already holds a capture \(profile.aiflame.partial\)"):
        _check_out_dir(tmp_path, force=False)
    _check_out_dir(tmp_path, force=True)


def test_export_joins_several_captures(capture: Path, tmp_path: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    """Two hosts' captures (here the same one twice, in a directory too) exported as one job: both hosts'
    samples, the second's clock move said on stderr; a directory without captures is refused in one line."""
    other = tmp_path / "node1" / "profile.aiflame"
    other.parent.mkdir()
    other.write_bytes(capture.read_bytes())
    out = tmp_path / "job.folded"
    assert main(["export", str(capture), str(tmp_path / "node1"), "-f", "folded", "-o", str(out)]) == 0
    err = capsys.readouterr().err
    assert "node1/profile.aiflame: clock +0.000 ms" in err and "from 0 collectives" in err, err
    lines = out.read_text().splitlines()
    assert lines and sum(int(line.rsplit(" ", 1)[1]) for line in lines) == 24  # 12 samples from each
    (tmp_path / "empty").mkdir()
    assert main(["export", str(tmp_path / "empty"), "-f", "folded", "-o", str(out)]) == 2
    _one_error_line(capsys.readouterr().err, "no .aiflame captures in this directory")

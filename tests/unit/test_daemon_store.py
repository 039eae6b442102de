"""The output tree: atomic publication, crash leftovers, and retention that deletes the oldest windows and
nothing else."""

from __future__ import annotations

import calendar
import itertools
import os
import time
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from aiflame.agent.daemon.store import (
    WINDOW_RE,
    OutputDirs,
    Stored,
    enforce_count,
    enforce_retention,
    plan_retention,
)


def _window(parent: Path, name: str, size: int, age_s: float) -> Path:
    d = parent / name
    d.mkdir()
    (d / "profile.aiflame").write_bytes(b"x" * size)
    t = time.time() - age_s
    os.utime(d, (t, t))
    return d


def test_retention_deletes_oldest_windows_and_nothing_else(tmp_path: Path) -> None:
    out = OutputDirs(tmp_path)
    assert out.prepare() == []
    w = out.windows
    old = _window(w, "20260101T000000Z-000001", 100, 10_000)
    mid = _window(w, "20260101T000100Z-000002", 100, 50)
    new = _window(w, "20260101T000200Z-000003", 100, 10)
    newest = _window(w, "20260101T000300Z-000004", 100, 1)
    foreign = w / "notes"  # not ours: never touched
    foreign.mkdir()
    (w / "README").write_text("keep")
    partial = out.new_partial(w, "20260101T000400Z-000005")
    deleted = enforce_retention(w, WINDOW_RE, time.time(), max_age_s=3600, max_bytes=250)
    assert deleted == [old, mid]
    assert new.exists() and newest.exists() and foreign.exists() and (w / "README").exists() and partial.exists()


def test_retention_keeps_the_newest_even_when_over_budget() -> None:
    stored = [Stored(Path(f"/x/{i}"), 0.0, 1000) for i in range(3)]
    assert [s.path.name for s in plan_retention(stored, 1e9, 1.0, 10)] == ["0", "1"]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 5000)), max_size=20), st.integers(0, 20_000),
       st.integers(1, 10_000))
def test_retention_plan_properties(items: list[tuple[int, int]], max_bytes: int, max_age: int) -> None:
    stored = [Stored(Path(f"/w/{i:04d}"), 100_000.0 - age, size) for i, (size, age) in enumerate(items)]
    doomed = plan_retention(stored, 100_000.0, max_age, max_bytes)
    kept = [s for s in stored if s not in doomed]
    # Only what is over age, or the oldest while over budget, goes.
    for s in doomed:
        older_total = sum(x.size for x in stored if x.path.name >= s.path.name)
        assert 100_000.0 - s.mtime > max_age or older_total > max_bytes
    if stored:
        assert stored[-1] in kept
    over_age = [s for s in kept[:-1] if 100_000.0 - s.mtime > max_age]
    assert not over_age
    if len(kept) > 1:
        assert sum(s.size for s in kept) <= max_bytes or len(kept) == 1


def test_publish_and_crash_leftovers(tmp_path: Path) -> None:
    out = OutputDirs(tmp_path)
    out.prepare()
    p = out.new_partial(out.windows, "20260101T000000Z-000001")
    (p / "profile.aiflame").write_bytes(b"data")
    final = out.publish(p)
    assert final.name == "20260101T000000Z-000001" and (final / "profile.aiflame").exists()
    out.new_partial(out.windows, "20260101T000100Z-000002")  # a crash left this behind
    notes = OutputDirs(tmp_path).prepare()
    assert (out.windows / "20260101T000100Z-000002-incomplete").is_dir() and len(notes) == 1
    assert (out.windows.stat().st_mode & 0o007) == 0  # no access for others


def test_captures_kept_by_count(tmp_path: Path) -> None:
    from aiflame.agent.daemon.store import CAPTURE_RE

    for i in range(5):
        (tmp_path / f"20260101T00000{i}Z-c{i:04d}").mkdir()
    deleted = enforce_count(tmp_path, CAPTURE_RE, 2)
    assert [d.name[-5:] for d in deleted] == ["c0000", "c0001", "c0002"]


def test_window_names_skip_taken_numbers(tmp_path: Path) -> None:
    out = OutputDirs(tmp_path)
    out.prepare()
    wall = calendar.timegm((2026, 1, 2, 3, 4, 5, 0, 0, 0))
    (out.windows / "20260102T030405Z-000000").mkdir()  # left by an earlier run in the same second
    seq = itertools.count()
    first = out.new_window(wall, seq)
    second = out.new_window(wall, seq)
    assert first.name == ".partial-20260102T030405Z-000001" and first.is_dir()
    assert second.name == ".partial-20260102T030405Z-000002"
    assert out.new_capture(wall, 7).name == ".partial-20260102T030405Z-c0007"
    assert out.latest_windows(5) == [out.windows / "20260102T030405Z-000000"]  # partials are not listed
    out.publish(first)
    out.publish(second)
    assert [p.name[-6:] for p in out.latest_windows(2)] == ["000001", "000002"]


def test_pruning_goes_through_the_retention_rules(tmp_path: Path) -> None:
    out = OutputDirs(tmp_path)
    out.prepare()
    old = _window(out.windows, "20260101T000000Z-000001", 10, 10_000)
    _window(out.windows, "20260101T000100Z-000002", 10, 1)
    assert out.prune_windows(time.time(), max_age_s=3600, max_bytes=1 << 20) == [old]
    for i in range(3):
        (out.captures / f"20260101T00000{i}Z-c{i:04d}").mkdir()
    assert [p.name[-5:] for p in out.prune_captures(1)] == ["c0000", "c0001"]

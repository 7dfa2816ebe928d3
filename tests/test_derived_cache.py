"""The test cache (conftest.derived_once, issue 69): a derived file is made once, then copied in later sessions while
its inputs are unchanged; changed inputs, a damaged entry or TEST_CACHE=off make it again, and a cache that cannot
be written costs only the time."""
from __future__ import annotations

import os
from pathlib import Path

import conftest
from conftest import derived_once


class Session:
    """A stand-in for pytest's tmp_path_factory of one session (its own base folder)."""

    def __init__(self, base: Path):
        self.base = base
        base.mkdir(parents=True)

    def getbasetemp(self) -> Path:
        return self.base


def make(tmp_path, monkeypatch, cache, inputs, session, calls):
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)  # the session's base is the shared folder's parent
    monkeypatch.setenv("TEST_CACHE", str(cache))

    def build(out: Path) -> None:
        calls.append(session)
        (out / "sub").mkdir()
        (out / "sub" / "made.txt").write_text("".join(p.read_text() if isinstance(p, Path) else p for p in inputs))

    return derived_once(Session(tmp_path / session), "thing", inputs, build) / "sub" / "made.txt"


def test_a_derived_file_is_made_once_and_made_again_when_an_input_changes(tmp_path, monkeypatch):
    cache, calls = tmp_path / "cache", []
    source = tmp_path / "source.py"
    source.write_text("one\n")
    first = make(tmp_path, monkeypatch, cache, (source, "RUN=1"), "s1", calls)
    assert first.read_text() == "one\nRUN=1" and calls == ["s1"]
    second = make(tmp_path, monkeypatch, cache, (source, "RUN=1"), "s2", calls)
    assert second.read_text() == "one\nRUN=1" and calls == ["s1"] and second != first  # copied, not made
    assert make(tmp_path, monkeypatch, cache, (source, "RUN=2"), "s3", calls).read_text() == "one\nRUN=2"
    source.write_text("two\n")
    assert make(tmp_path, monkeypatch, cache, (source, "RUN=1"), "s4", calls).read_text() == "two\nRUN=1"
    assert calls == ["s1", "s3", "s4"]
    # a damaged entry (a byte changed on disk) is found by its sha256 and made again
    entry = next(p for p in cache.iterdir() if (p / "files" / "sub" / "made.txt").read_text() == "two\nRUN=1")
    (entry / "files" / "sub" / "made.txt").write_text("two\nRUN=9")
    assert make(tmp_path, monkeypatch, cache, (source, "RUN=1"), "s5", calls).read_text() == "two\nRUN=1"
    assert calls[-1] == "s5"
    assert make(tmp_path, monkeypatch, cache, (source, "RUN=1"), "s6", calls).read_text() == "two\nRUN=1"
    assert calls[-1] == "s5"  # the mended entry serves again


def test_off_or_unwritable_the_cache_costs_only_the_time(tmp_path, monkeypatch):
    calls = []
    for session in ("s1", "s2"):
        assert make(tmp_path, monkeypatch, "off", ("x",), session, calls).read_text() == "x"
    assert calls == ["s1", "s2"]
    blocked = tmp_path / "a_file"
    blocked.write_text("not a folder")
    for session in ("s3", "s4"):
        assert make(tmp_path, monkeypatch, blocked / "cache", ("x",), session, calls).read_text() == "x"
    assert calls == ["s1", "s2", "s3", "s4"]


def test_the_cache_keeps_its_most_recently_used_entries(tmp_path, monkeypatch):
    monkeypatch.setattr(conftest, "TEST_CACHE_ENTRIES", 2)
    cache, calls = tmp_path / "cache", []
    for i, value in enumerate("abc"):
        make(tmp_path, monkeypatch, cache, (value,), f"s{i}", calls)
        for entry in cache.iterdir():  # mtimes a second apart, older first, whatever the file system's resolution
            os.utime(entry, (entry.stat().st_mtime - 10, entry.stat().st_mtime - 10))
    assert len(list(cache.iterdir())) == 2
    make(tmp_path, monkeypatch, cache, ("a",), "s3", calls)  # the oldest was dropped: made again
    assert calls == ["s0", "s1", "s2", "s3"]

"""The event timeline and the goodput report: a real run killed and resumed, rendered; a
hostile event file; a full disk while appending; a directory that is not a run."""

from __future__ import annotations

import errno
import json
import logging
import os
import signal
import struct
from pathlib import Path

import pytest

from support.launch import PYTHON, finish, launch, run, run_job
from support.runs import train_args
from support.logs import our_records
from train import events, report
from train.events import read_events


def png_size(path: Path) -> tuple:
    """(width, height) of a PNG, from its header; fails on anything else."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR", "not a PNG"
    return struct.unpack(">II", data[16:24])


def kinds(attempt: report.Attempt) -> list:
    return [e.kind for e in attempt.events]


def test_a_killed_and_resumed_run_has_a_timeline_and_a_report(tiny_root, tmp_path, capsys):
    # Synchronous saves: step 4's checkpoint is committed when the kill comes at step 5.
    args = train_args(tiny_root, tmp_path, "checkpoint.async_mode=off", strategy="single")
    run_dir = tmp_path / "r"
    killed = launch(PYTHON, args, fault="kill:step=5")
    out = finish(killed, timeout=180)
    assert killed.returncode == -signal.SIGKILL, out[-3000:]

    # The crashed run's directory: no exit, and a report all the same.
    assert report.main([str(run_dir)]) == 0
    table = capsys.readouterr().out
    assert "last attempt left no exit: killed, or still running" in table
    assert png_size(run_dir / "goodput.png")

    out = run_job(PYTHON, args, timeout=180)
    assert "goodput report (python -m train.report" in out  # made at the end of the run
    timeline = read_events(run_dir / "events.jsonl")
    assert timeline.skipped == 0
    first, second = report.attempts_of(timeline.events)
    assert kinds(first)[:2] == ["start", "first_step"] and "exit" not in kinds(first)
    # A commit is recorded at the next step: step 4's only by the resume from it.
    assert [e["step"] for e in first.of("save_staged")] == [2, 4]
    assert [e["step"] for e in first.of("save_committed")] == [2]
    assert [e["step"] for e in second.of("resume")] == [4]  # where the kill left it
    assert [e["step"] for e in second.of("first_step")] == [5]
    assert [e["step"] for e in second.of("save_committed")] == [6, 8, 10, 12]
    assert [e["code"] for e in second.of("exit")] == [0] and kinds(second)[-2:] == ["end", "exit"]
    assert all(e.pid == killed.pid for e in first.events)  # no torchrun: the trainer itself
    assert first.start < first.last < second.start

    assert report.main([str(run_dir)]) == 0
    table = capsys.readouterr().out
    for part in ("goodput ", "compute", "data wait", "checkpoint stall", "restore", "lost"):
        assert part in table, part
    assert "restarts 1" in table and "failures 1 (killed 1)" in table
    assert "6 committed" in table and "last attempt exited with code 0" in table
    books = json.loads((run_dir / "goodput.json").read_text())
    total = sum(books["seconds"].values())
    assert f"goodput {books['seconds']['compute'] / total:.1%}" in table  # the run's books
    width, height = png_size(run_dir / "goodput.png")
    assert 900 <= width <= 1600 and 450 <= height <= 900, (width, height)
    assert (run_dir / "goodput.png").stat().st_size > 20_000  # drawn, not blank


def event_line(kind: str, **fields) -> str:
    return json.dumps({"kind": kind, "time": 1000.0, "rank": 0, "pid": 1, "attempt": "a",
                       "restart": 0, **fields})


def test_a_hostile_event_file_is_read_around(tmp_path, capsys):
    good = [event_line("start", world_size=1), event_line("first_step", step=1),
            event_line("save_staged", step=2, stall=0.1), event_line("exit", code=0)]
    bad = ["garbage", "\x00\xff{", "[1, 2]", "null",
           "[" * 20_000 + "]" * 20_000,  # nesting deeper than the parser's stack
           "x" * (1 << 20),  # huge
           event_line("first_step", step="5"), event_line("first_step", step=True),
           event_line("first_step", step=-1), event_line("save_staged", step=2, stall=1e999),
           event_line("exit", code=0, rank=-3), event_line("exit", code=0, time="noon"),
           event_line("exit", code=0, step="x"),  # a field of no kind of its own: unchecked
           event_line("no_such_kind"), event_line("exit"), event_line("fault", source="x",
                                                                      error="e", step=1.5)]
    torn = event_line("exit", code=1)[:30]
    lines = [bad[0], good[0], *bad[1:6], good[1], "", *bad[6:], good[2], good[3]]
    path = tmp_path / "events.jsonl"
    path.write_bytes(("\n".join(lines) + "\n" + torn).encode("utf-8", "surrogateescape"))
    timeline = read_events(path)
    kept = [e.kind for e in timeline.events]
    # "exit ... step=x": a stray field is dropped, the event is kept
    assert sorted(kept) == sorted(["start", "first_step", "save_staged", "exit", "exit"])
    assert timeline.skipped == len(bad)  # all bad lines but the stray field, and the torn one
    assert report.main([str(tmp_path)]) == 0
    assert f"{timeline.skipped} unreadable line(s) skipped" in capsys.readouterr().out
    assert png_size(tmp_path / "goodput.png")
    (tmp_path / "goodput.json").write_text('{"seconds": {"compute": "NaN"}}')
    assert report.main([str(tmp_path)]) == 0
    assert "goodput unknown: goodput.json cannot be read" in capsys.readouterr().out


def test_a_full_disk_stops_the_timeline_with_one_warning(tmp_path, monkeypatch, caplog):
    events.open_timeline(tmp_path, rank=0, world_size=1, started_at=1.0)
    writes = []

    def full(fd: int, data: bytes) -> int:
        writes.append(data)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(events.os, "write", full)
    with caplog.at_level(logging.WARNING, logger="train.events"):
        for step in range(3):
            events.record("progress", step=step)  # no exception: training goes on
    events.close()
    assert len(writes) == 1 and len(our_records(caplog)) == 1
    assert "events.jsonl" in caplog.text and "No space left" in caplog.text
    assert [e.kind for e in read_events(tmp_path / "events.jsonl").events] == ["start"]


def test_a_directory_that_is_not_a_run_is_one_line(tmp_path):
    for target in (tmp_path / "missing", tmp_path):
        result = run(PYTHON, ["-m", "train.report", str(target)])
        assert result.returncode == 2 and result.stdout == ""
        line, = result.stderr.splitlines()
        assert line.startswith("error: ") and "is not a run directory" in line
        assert "outputs/<run name>" in line


BOOKS = {"compute": 1.0, "data_wait": 1.0, "checkpoint_stall": 1.0, "restore": 1.0, "lost": 1.0}


@pytest.mark.parametrize("source", ["$\\frac{$", "$", "a $x^$ b", "$$", "\\$\\"])
@pytest.mark.parametrize("name", ["plain", "cost $5", "$\\sqrt{$"])
def test_event_text_and_run_names_are_drawn_as_text_not_formulas(tmp_path, capsys, source,
                                                                  name):
    run_dir = tmp_path / name
    run_dir.mkdir()
    (run_dir / "events.jsonl").write_text(
        event_line("start", world_size=1) + "\n"
        + event_line("fault", source=source, error="e") + "\n" + event_line("exit", code=1)
        + "\n")
    assert report.main([str(run_dir)]) == 0, capsys.readouterr()
    assert png_size(run_dir / "goodput.png")


@pytest.mark.parametrize("seconds", [dict(BOOKS, compute=1e308, lost=1e308),
                                     dict(BOOKS, compute=float("inf")),
                                     dict(BOOKS, restore=-1.0)])
def test_books_whose_total_is_not_a_time_are_refused(tmp_path, capsys, seconds):
    (tmp_path / "goodput.json").write_text(json.dumps({"seconds": seconds}))
    assert report.main([str(tmp_path)]) == 0
    assert "goodput unknown: goodput.json holds impossible times" in capsys.readouterr().out


@pytest.mark.parametrize("out, says", [("x.xyz", "Format 'xyz' is not supported"),
                                       (".", "not a regular file"),
                                       ("/dev/null", "not a regular file"),
                                       ("no/x.png", "No such file or directory")])
def test_a_picture_that_cannot_be_written_is_one_line(tmp_path, capsys, out, says):
    (tmp_path / "goodput.json").write_text(json.dumps({"seconds": BOOKS}))
    assert report.main([str(tmp_path), "--out", str(tmp_path / out)]) == 2
    err = capsys.readouterr().err
    line, = err.splitlines()
    assert line.startswith("error: cannot write ") and says in line and "--out PATH" in line
    assert not (tmp_path / "no").exists() and os.path.exists("/dev/null")


@pytest.mark.parametrize("failure", [OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)),
                                     KeyboardInterrupt()])
def test_a_picture_cut_short_keeps_the_previous_one(tmp_path, monkeypatch, failure):
    # A full disk, or a signal while the end-of-run report renders: half a picture is
    # written, then the write fails. The previous picture stays whole, nothing is left over.
    (tmp_path / "goodput.json").write_text(json.dumps({"seconds": BOOKS}))
    assert report.main([str(tmp_path)]) == 0
    before = (tmp_path / "goodput.png").read_bytes()
    from matplotlib.figure import Figure

    def half(self, f, **kwargs):
        f.write(before[:100])
        raise failure

    monkeypatch.setattr(Figure, "savefig", half)
    with pytest.raises(type(failure)):
        report.render(report.load_run(tmp_path), tmp_path / "goodput.png")
    assert (tmp_path / "goodput.png").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["goodput.json", "goodput.png"]


def test_a_picture_path_without_a_suffix_is_a_png_there(tmp_path, capsys):
    (tmp_path / "goodput.json").write_text(json.dumps({"seconds": BOOKS}))
    assert report.main([str(tmp_path), "--out", str(tmp_path / "picture")]) == 0
    assert f"picture: {tmp_path / 'picture'}" in capsys.readouterr().out
    assert png_size(tmp_path / "picture")

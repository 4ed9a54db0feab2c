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
from support.streams import read_through_fifo
from train.records import events, report
from train.records.events import read_events


def png_size(path: Path) -> tuple:
    """(width, height) of a PNG, from its header; fails on anything else."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR", "not a PNG"
    return struct.unpack(">II", data[16:24])


def kinds(events: list) -> list:
    return [e.kind for e in events]


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
    by_attempt = {}
    for e in timeline.events:
        by_attempt.setdefault(e.attempt, []).append(e)
    first, second = sorted(by_attempt.values(), key=lambda events: events[0].time)
    of = lambda events, kind: [e["step"] for e in events if e.kind == kind]  # noqa: E731
    assert kinds(first)[:2] == ["start", "first_step"] and "exit" not in kinds(first)
    # A commit is recorded at the next step: step 4's only by the resume from it.
    assert of(first, "save_staged") == [2, 4] and of(first, "save_committed") == [2]
    assert of(second, "resume") == [4]  # where the kill left it
    assert of(second, "first_step") == [5]
    assert of(second, "save_committed") == [6, 8, 10, 12]
    assert [e["code"] for e in second if e.kind == "exit"] == [0]
    assert kinds(second)[-2:] == ["end", "exit"]
    assert all(e.pid == killed.pid for e in first)  # no torchrun: the trainer itself
    # The report's summary of each attempt, from the same events
    died, resumed = report.attempts_of(timeline.events)
    assert died.exit_code is None and died.running == {0} and list(died.staged_open) == [4]
    assert resumed.resumed_from == 4 and resumed.first_step["step"] == 5
    assert resumed.committed.count == 4 and resumed.exit_code == 0 and not resumed.running
    assert died.start < died.last < resumed.start

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
    with caplog.at_level(logging.WARNING, logger="train.records.events"):
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


# ---- a month of events: streamed, summed exactly, drawn from a bounded sample ----

def month_of_events(attempts: int, steps_each: int, ranks: int = 4):
    """Events as a generator (never a list): `attempts` attempts of `steps_each` steps,
    progress every step, a save every 10 with one failed in every 7th attempt, a rollback
    in every 5th; killed attempts but the last; the save in flight at a kill cut short in
    odd attempts, resumed from (so committed) in even ones. Yields, then returns nothing:
    the expected totals are in `month_totals`."""
    t, step = 1e9, 0
    for a in range(attempts):
        last = a == attempts - 1
        ident = f"a{a}"
        e = lambda kind, rank=0, **f: events.Event(kind, t, rank, 100 + a, ident, 0, f)  # noqa: E731
        for rank in range(ranks):
            yield e("start", rank, world_size=ranks)
        if a:
            yield e("resume", step=step, seconds=1.0)
        yield e("first_step", step=step + 1)
        for _ in range(steps_each):
            step += 1
            t += 1.0
            yield e("progress", step=step)
            if step % 10 == 0:
                yield e("save_staged", step=step, stall=0.01)
                if step % 10 == 0 and (step // 10) % steps_each and not (a % 7 == 0 and
                                                                       step % 30 == 0):
                    yield e("save_committed", step=step, seconds=0.5)
                elif a % 7 == 0 and step % 30 == 0:
                    yield e("save_failed", step=step, error="disk")
        if a % 5 == 4:
            yield e("rollback", step=step, to_step=step - 5, seconds=2.0)
            step -= 5
        if last:
            yield e("end", step=step)
            for rank in range(ranks):
                yield e("exit", rank, code=0)
        t += 5.0


def test_a_month_of_events_is_summed_exactly_from_a_stream_and_drawn_bounded(tmp_path):
    attempts, steps_each = 20, 5_000  # 100,000 progress events
    run = report.Run(tmp_path, None, "no books",
                     report.attempts_of(month_of_events(attempts, steps_each)))
    # The same sums, counted the slow way over every event of a fresh stream
    all_events = list(month_of_events(attempts, steps_each))
    of = lambda kind: [e for e in all_events if e.kind == kind]  # noqa: E731
    c = report.counts(run)
    assert len(run.attempts) == attempts and c.restarts == attempts - 1
    assert c.failed_saves == len(of("save_failed"))
    assert c.failures == {"killed": attempts - 1, "exception": 0,
                          "health": len(of("rollback")), "preemption": 0}
    landed = {(e.attempt, e["step"]) for e in of("save_committed") + of("save_failed")}
    in_flight = [e for e in of("save_staged") if (e.attempt, e["step"]) not in landed]
    resumed = {(f"a{i - 1}", e["step"]) for i, e in enumerate(of("resume"), 1)}
    late = [e for e in in_flight if (e.attempt, e["step"]) in resumed]
    assert c.committed == len(of("save_committed")) + len(late)
    assert c.cut_short == len(in_flight) - len(late)
    assert max(a.top for a in run.attempts) == max(e["step"] for e in of("progress"))
    # Drawn from a sample of fixed size, however many progress events there were
    points = sum(len(a.curve()) for a in run.attempts)
    assert points <= report.MAX_POINTS + 8 * attempts, points
    assert run.attempts[-1].curve()[-1][1] == of("end")[0]["step"]


def test_thousands_of_attempts_are_drawn_as_one_aggregate(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run = report.Run(tmp_path, None, "no books",
                     report.attempts_of(month_of_events(2_000, 3, ranks=1)))
    fig, ax = plt.subplots()
    try:
        report.draw_timeline(ax, run)
        # text labels for the first MAX_LABELLED attempts' sake only, and a fixed number
        # of collections and lines, not some per attempt
        assert len(ax.texts) + len(ax.lines) + len(ax.collections) <= 12
        assert "2,000 attempts" in ax.texts[0].get_text()
    finally:
        plt.close(fig)


def test_the_report_reads_events_as_they_come(tmp_path):
    lines = [event_line("start", world_size=1), "garbage", event_line("exit", code=0)]
    stream = events.EventStream(tmp_path / "events.jsonl")
    read, streamed = read_through_fifo(tmp_path / "events.jsonl", lines, lambda _: stream)
    assert streamed and [e.kind for e in read] == ["start", "exit"] and stream.skipped == 1


def test_only_rank_0_records_what_all_ranks_do_together(tmp_path):
    for rank in (1, 0):
        events.open_timeline(tmp_path, rank=rank, world_size=2, started_at=1.0)
        events.record_once("save_staged", step=2, stall=0.1)
        events.close()
    kept = [(e.rank, e.kind) for e in read_events(tmp_path / "events.jsonl").events]
    assert sorted(kept) == [(0, "save_staged"), (0, "start"), (1, "start")]

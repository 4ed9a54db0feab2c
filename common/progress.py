"""Progress display, one rule for all long work: a rich bar on a terminal; otherwise a plain
log line every `every` of the way (and at the end), so CI logs and files stay readable:
nothing animates there."""

from __future__ import annotations

import logging
import sys
import time
from contextlib import contextmanager
from typing import TYPE_CHECKING, Callable, Iterator, Optional, Sequence

if TYPE_CHECKING:
    from rich.progress import Progress as RichProgress


def is_interactive() -> bool:
    return sys.stdout.isatty()


def progress_bar(label: str, *texts: str) -> "RichProgress":
    """A rich bar with columns `label`, the bar, done/total, `texts` (rich format strings
    such as "{task.fields[stats]}"), elapsed and remaining time."""
    # imported only when a bar is drawn: runs without a terminal never need rich
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                               TimeElapsedColumn, TimeRemainingColumn)

    return Progress(TextColumn(label), BarColumn(), MofNCompleteColumn(),
                    *(TextColumn(t) for t in texts), TimeElapsedColumn(), TimeRemainingColumn())


# What a non-terminal run logs: (done, total, stats, seconds since the start).
Report = Callable[[int, int, str, float], None]


class Progress:
    """`total` units of work, `done` of them already: `update(done)` draws the bar, or calls
    `report` at the first update, every `every` of the total after it, and at the end."""

    def __init__(self, description: str, total: int, report: Report, done: int = 0,
                 every: float = 0.1, texts: Sequence[str] = ()) -> None:
        self.total, self.report, self.every = total, report, every
        self.start, self.next_report = time.perf_counter(), done
        self.bar: Optional["RichProgress"] = None
        if is_interactive():
            self.bar = progress_bar("{task.description}", *texts)
            self.task = self.bar.add_task(description, total=total, completed=done, stats="")

    def __enter__(self) -> "Progress":
        if self.bar:
            self.bar.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.bar:
            self.bar.stop()

    def update(self, done: int, total: Optional[int] = None, stats: str = "") -> None:
        self.total = self.total if total is None else total
        if self.bar:
            self.bar.update(self.task, completed=done, total=self.total, stats=stats)
        elif done >= self.next_report or done == self.total:
            self.report(done, self.total, stats, time.perf_counter() - self.start)
            self.next_report = done + max(1, int(self.total * self.every))


@contextmanager
def task_progress(description: str, total: int,
                  log: logging.Logger) -> Iterator[Callable[[int, int], None]]:
    """Yields `update(done, total)` for a `Progress` that logs to `log` every ~10%."""
    def report(done: int, total: int, stats: str, seconds: float) -> None:
        log.info("%s: %d/%d (%.0f%%, %.1fs)", description, done, total,
                 100 * done / max(total, 1), seconds)

    with Progress(description, total, report) as progress:
        yield lambda done, total: progress.update(done, total)

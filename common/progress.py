"""Progress display: a rich bar on a terminal. Callers log a few plain lines instead when
`is_interactive()` is false, so CI logs and files stay readable: nothing animates there."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rich.progress import Progress


def is_interactive() -> bool:
    return sys.stdout.isatty()


def progress_bar(label: str, *texts: str) -> "Progress":
    """A rich bar with columns `label`, the bar, done/total, `texts` (rich format strings
    such as "{task.fields[stats]}"), elapsed and remaining time."""
    # imported only when a bar is drawn: runs without a terminal never need rich
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                               TimeElapsedColumn, TimeRemainingColumn)

    return Progress(TextColumn(label), BarColumn(), MofNCompleteColumn(),
                    *(TextColumn(t) for t in texts), TimeElapsedColumn(), TimeRemainingColumn())

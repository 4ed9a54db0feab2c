"""Progress for long work: a rich bar on a terminal, a few plain log lines otherwise.

CI logs and files stay readable because nothing animates when stdout is not a terminal.
"""

from __future__ import annotations

import logging
import time
from contextlib import contextmanager
from typing import Callable, Iterator

from common.progress import is_interactive, progress_bar

log = logging.getLogger(__name__)


@contextmanager
def task_progress(description: str, total: int) -> Iterator[Callable[[int, int], None]]:
    """Yields `update(done, total)`; draws a bar, or logs every ~10% when not a terminal."""
    if is_interactive():
        with progress_bar("{task.description}") as bar:
            task = bar.add_task(description, total=total)
            yield lambda done, total: bar.update(task, completed=done, total=total)
        return

    start = time.perf_counter()
    next_report = [0.0]

    def update(done: int, total: int) -> None:
        fraction = done / max(total, 1)
        if fraction >= next_report[0] or done == total:
            log.info("%s: %d/%d (%.0f%%, %.1fs)", description, done, total, 100 * fraction,
                     time.perf_counter() - start)
            next_report[0] = fraction + 0.1

    yield update

"""The training progress display: step bar with loss, images/s and ETA on a terminal; a log
line every ~5% of the run otherwise."""

from __future__ import annotations

import logging
import time
from typing import Dict, Optional

from common.progress import is_interactive, progress_bar
from train.tracking.tracker import describe

log = logging.getLogger(__name__)


class ProgressBar:
    def __init__(self, total_steps: int, start_step: int = 0) -> None:
        self.total, self.start = total_steps, time.perf_counter()
        self.next_report = start_step
        self.bar = None
        if is_interactive():
            self.bar = progress_bar("train", "{task.fields[stats]}")
            self.task = self.bar.add_task("train", total=total_steps, completed=start_step,
                                          stats="")

    def __enter__(self) -> "ProgressBar":
        if self.bar:
            self.bar.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.bar:
            self.bar.stop()

    def update(self, step: int, metrics: Optional[Dict[str, float]] = None) -> None:
        stats = describe(metrics or {}, ["train/loss", "train/images_per_second"])
        if self.bar:
            self.bar.update(self.task, completed=step, stats=stats)
        elif step >= self.next_report or step == self.total:
            elapsed = time.perf_counter() - self.start
            log.info("step %d/%d %s (%.0fs)", step, self.total, stats, elapsed)
            self.next_report = step + max(1, self.total // 20)

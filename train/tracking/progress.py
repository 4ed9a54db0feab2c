"""The training progress display: step bar with loss, images/s and ETA on a terminal; a log
line every ~5% of the run otherwise."""

from __future__ import annotations

import logging
from typing import Dict, Optional

from common.progress import Progress
from train.tracking.tracker import describe

log = logging.getLogger(__name__)


class ProgressBar:
    def __init__(self, total_steps: int, start_step: int = 0) -> None:
        self.progress = Progress("train", total_steps, self._report, done=start_step,
                                 every=0.05, texts=["{task.fields[stats]}"])

    def __enter__(self) -> "ProgressBar":
        self.progress.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.progress.__exit__(*exc)

    def update(self, step: int, metrics: Optional[Dict[str, float]] = None) -> None:
        self.progress.update(step, stats=describe(metrics or {}, ["train/loss",
                                                                  "train/images_per_second"]))

    @staticmethod
    def _report(step: int, total: int, stats: str, seconds: float) -> None:
        log.info("step %d/%d %s (%.0fs)", step, total, stats, seconds)

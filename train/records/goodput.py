"""Goodput: where a run's wall time went, over its whole life (every process of it).

Five parts: `compute` (steps that count), `data_wait` (the loop waiting for a batch),
`checkpoint_stall` (the loop blocked by a save), `restore` (start-up, resume and rollback
loads) and `lost` (steps done again after a crash or rollback: their time, first counted as
compute and data wait, moves here). `goodput` = compute / all of it.

Rank 0 keeps the totals in `<run dir>/goodput.json`, rewritten at every log line, so the
next process of the run continues them and knows how far the last one got. After a crash,
the wall time from the dead process's last log line to the new process's start (its last
steps, detecting the failure, the restart) is lost too; after a clean end, the time until
someone runs the command again counts for nothing.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Dict, Optional

from common.files import atomic_write
from common.run_files import PARTS, read_goodput

log = logging.getLogger(__name__)


class Goodput:
    def __init__(self, path: Optional[Path], process_start: float) -> None:
        """`path`: the totals file (None on ranks other than 0: they keep no books);
        `process_start`: `time.perf_counter()` when this process began."""
        self.path, self.process_start = path, process_start
        self.started_at = time.time() - (time.perf_counter() - process_start)  # wall clock
        self.seconds: Dict[str, float] = dict.fromkeys(PARTS, 0.0)
        self.reached = 0  # the highest step this run's processes are known to have done
        self.counted_steps = 0  # steps whose time is in compute and data_wait
        self.mark = process_start  # where the time accounted so far ends
        if path is not None and path.exists():
            self._continue(path)

    def _continue(self, path: Path) -> None:
        """Continue the totals an earlier process of the run left; a file cut short (a full
        disk, a kill mid-write on a store without atomic rename) or edited costs the report
        its history, never the start."""
        saved, problem = read_goodput(path)
        if saved is None:
            log.warning("%s (%s): the goodput totals start again from zero; training goes on",
                        problem, path)
            return
        self.seconds.update(saved.seconds)
        self.reached, self.counted_steps = saved.reached, saved.counted_steps
        # The last process died: the time since its last word is lost.
        if not saved.ended and saved.saved_at is not None:
            self.seconds["lost"] += max(self.started_at - saved.saved_at, 0.0)

    def started(self, step: int) -> None:
        """The loop starts at `step`: what came before was restore; steps beyond it that an
        earlier process already did are lost."""
        self.mark = time.perf_counter()
        self.seconds["restore"] += self.mark - self.process_start
        self.lose(self.reached - step)
        self.reached = max(self.reached, step)

    def step_done(self, step: int, data_wait: float, stall: float) -> None:
        """Step `step` is done: the loop time since the last one (its evaluation and logging
        included) was compute but for `data_wait` and the checkpoint `stall` (a save of this
        step: the totals are written too, or a crash before the next log line would count
        steps the resume keeps as lost)."""
        now = time.perf_counter()
        self.seconds["compute"] += max(now - self.mark - data_wait - stall, 0.0)
        self.seconds["data_wait"] += data_wait
        self.seconds["checkpoint_stall"] += stall
        self.counted_steps += 1
        self.reached = max(self.reached, step)
        self.mark = now
        if stall > 0:
            self.save()

    def rolled_back(self, bad_step: int, to_step: int, began: float) -> None:
        """A rollback that began at `began` (perf_counter) from `bad_step` to `to_step`: the
        bad step and the ones after the checkpoint are lost, the reload is restore."""
        now = time.perf_counter()
        self.seconds["lost"] += began - self.mark
        self.seconds["restore"] += now - began
        self.lose(bad_step - 1 - to_step)
        self.mark = now

    def lose(self, steps: int) -> None:
        """`steps` counted steps will be done again: move their share of time to lost."""
        steps = min(steps, self.counted_steps)
        if steps <= 0:
            return
        for part in ("compute", "data_wait"):
            share = self.seconds[part] * steps / self.counted_steps
            self.seconds[part] -= share
            self.seconds["lost"] += share
        self.counted_steps -= steps

    def metrics(self) -> Dict[str, float]:
        total = sum(self.seconds.values())
        return {"goodput": self.seconds["compute"] / total if total else 0.0,
                **{f"goodput/{part}_seconds": s for part, s in self.seconds.items()}}

    def save(self, ended: bool = False) -> None:
        """Rank 0: write the totals (atomically: a crash mid-write keeps the old ones);
        `ended` when the process ends cleanly."""
        if self.path is None:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write(self.path, json.dumps({"seconds": self.seconds, "reached": self.reached,
                                                "counted_steps": self.counted_steps,
                                                "saved_at": time.time(),
                                                "ended": ended}).encode())
        except OSError as err:  # a report, not training's state: a full disk must not stop it
            log.warning("cannot write %s (%s): the goodput totals there are stale; training "
                        "goes on", self.path, err.strerror or err)

    def summary(self) -> str:
        parts = ", ".join(f"{p.replace('_', ' ')} {s:.1f}s" for p, s in self.seconds.items())
        return f"goodput {self.metrics()['goodput']:.1%} over the run's life ({parts})"

"""The files of a run's directory that more than one package reads, named once, and the
goodput totals read back as the hostile input they are.

`goodput.json` is rewritten by rank 0 at every log line (train/records/goodput.py) and read by the
next process of the run, the report and the checkpoint-interval planner. A full disk or a
kill can leave it truncated, and anyone can edit it: `read_goodput` checks every field and
says why it refuses a file, never raises.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Optional, Tuple, Union

from common.files import open_regular

EVENTS_FILE = "events.jsonl"  # the event timeline (train/records/events.py)
GOODPUT_FILE = "goodput.json"  # the goodput totals
HEALTH_FILE = "health.json"  # the global batches a health rollback skipped (train/recovery/health.py)
PICTURE = "goodput.png"  # the report's picture (train/records/report.py)

PARTS = ("compute", "data_wait", "checkpoint_stall", "restore", "lost")
MAX_GOODPUT_BYTES = 1 << 16  # ours are ~250 bytes; a bigger file is not ours


@dataclass(frozen=True)
class GoodputTotals:
    """What `goodput.json` holds: the seconds of each part, the highest step reached, the
    steps whose time is in compute and data wait, when it was written (wall clock; None
    when the file does not say) and whether the process that wrote it ended cleanly."""
    seconds: Dict[str, float]
    reached: int = 0
    counted_steps: int = 0
    saved_at: Optional[float] = None
    ended: bool = False


def _number(value: object) -> float:
    """A finite, non-negative JSON number (not a bool, not a string), or ValueError."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(value)
    number = float(value)
    if not (math.isfinite(number) and number >= 0):
        raise ValueError(value)
    return number


def read_goodput(path: Union[str, Path]) -> Tuple[Optional[GoodputTotals], str]:
    """The totals in `path`, checked, or (None, why not): missing, unreadable, truncated,
    not ours, or holding impossible numbers."""
    name = Path(path).name
    try:
        with os.fdopen(open_regular(path, os.O_RDONLY), "rb") as f:  # a FIFO: no wait
            raw = f.read(MAX_GOODPUT_BYTES + 1)
    except FileNotFoundError:
        return None, f"no {name}"
    except OSError as err:
        return None, f"{name} cannot be read ({err.strerror or err})"
    try:
        if len(raw) > MAX_GOODPUT_BYTES:
            raise ValueError("too big")
        books = json.loads(raw)
        seconds = books["seconds"]
        if not all(isinstance(seconds.get(p), (int, float)) for p in PARTS):
            raise ValueError("a part is missing or not a number")
        ended = books.get("ended", False)
        saved_at = books.get("saved_at")
        reached, counted = books.get("reached", 0), books.get("counted_steps", 0)
        if not isinstance(ended, bool) or not all(
                isinstance(n, int) and not isinstance(n, bool) for n in (reached, counted)):
            raise ValueError("wrong types")
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError):
        return None, f"{name} cannot be read"
    try:
        totals = GoodputTotals({p: _number(seconds[p]) for p in PARTS}, int(_number(reached)),
                               int(_number(counted)),
                               None if saved_at is None else _number(saved_at), ended)
    except (ValueError, OverflowError):
        return None, f"{name} holds impossible times"
    if not math.isfinite(sum(totals.seconds.values())):
        return None, f"{name} holds impossible times"
    return totals, ""

"""The event timeline: what happened to a run, when, in which process.

Every process of a run (every rank, every restart) appends to `<run dir>/events.jsonl`, one
JSON object a line (common/jsonl.py, as the audit ledger does: lines of concurrent ranks
never interleave):

    {"kind": "save_staged", "time": 1764489600.123, "rank": 0, "pid": 4711,
     "attempt": "3f2a9c1b", "restart": 0, "step": 40, "stall": 0.021}

`time` is wall-clock seconds since the epoch; `attempt` is made up by rank 0 each time a
group of processes starts and shared by all of its ranks (torchrun's restart count, in
`restart`, is per agent, so it cannot name a round); the kinds and their fields are in
`KINDS`. It is a process-wide record, like logging: `open_timeline` once the process knows
its rank, then `record(...)` from anywhere; before that, and after `close`, recording does
nothing. A full disk stops the appending (one warning), never training.

Read back, the file is hostile input (a torn last line, garbage, huge lines, wrong types):
`read_events` keeps what it can check and counts what it skipped.
"""

from __future__ import annotations

import json
import logging
import math
import os
import socket
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional

from common.jsonl import Appender, lines
from common.run_files import EVENTS_FILE
from common.redact import strip_credentials
from train.cluster.preemption import Preempted

log = logging.getLogger(__name__)

MAX_TEXT = 300  # characters of an error kept in an event
MAX_EVENTS = 1_000_000  # read_events stops there (its list: about 1 GB of events)

# The fields of each kind beyond the common ones; `float` also takes an int.
KINDS: Dict[str, Dict[str, type]] = {
    "start": {"world_size": int},  # `time` is when the process began, imports included
    "first_step": {"step": int},  # the first batch of the process's first step arrived
    "progress": {"step": int},  # rank 0, at each log line: steps done
    "save_staged": {"step": int, "stall": float},  # rank 0; `stall`: the loop waited
    "save_committed": {"step": int, "seconds": float},  # rank 0; `time`: when it landed
    "save_failed": {"step": int, "error": str},
    "resume": {"step": int, "seconds": float},  # loaded checkpoint `step` in `seconds`
    "rollback": {"step": int, "to_step": int, "seconds": float},  # health: reloaded
    "fault": {"source": str, "error": str},  # source: health, preemption, exception
    "end": {"step": int},  # trained to the last step
    # strategy=ddp_ft: this replica group copied a healthy peer's state, `step` -> `to_step`
    "heal": {"step": int, "to_step": int, "seconds": float},
    "regroup": {"step": int, "participants": int},  # ddp_ft: step's replica groups changed
    # ddp_ft, at the end: the steps this group trained alone, no other group taking part since
    "alone": {"steps": str, "count": int},
    "exit": {"code": int},
}
OPTIONAL: Dict[str, Dict[str, type]] = {"fault": {"step": int}, "start": {"host": str}}
COMMON: Dict[str, type] = {"time": float, "rank": int, "pid": int, "attempt": str,
                           "restart": int}


class Timeline:
    """This process's appender to a run's event file."""

    def __init__(self, path: Path, rank: int, attempt: str) -> None:
        self.path, self.rank = path, rank
        self.common = {"rank": rank, "pid": os.getpid(), "attempt": attempt,
                       "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))}
        self._file: Optional[Appender] = Appender(path)

    def record(self, kind: str, at: Optional[float] = None, **fields: Any) -> None:
        """One line: `kind` with `fields`, at `at` (wall clock; default now)."""
        entry = {"kind": kind, "time": round(time.time() if at is None else at, 3),
                 **self.common, **fields}
        if self._file is None:
            return
        try:
            self._file.append(entry)
        except OSError as err:  # a record of the run, not its state: training goes on
            log.warning("cannot append to %s (%s): the run's event timeline stops here; "
                        "training goes on", self.path, err.strerror or err)
            self.close()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


_timeline: Optional[Timeline] = None


def open_timeline(run_dir: Path, rank: int, world_size: int, started_at: float,
                  broadcast: Callable[[str], str] = lambda attempt: attempt) -> None:
    """Every rank, together (`broadcast` hands rank 0's attempt id to all): start
    appending to `run_dir`'s timeline with a `start` event at `started_at` (wall clock)."""
    global _timeline
    attempt = broadcast(uuid.uuid4().hex[:8])
    close()
    try:
        _timeline = Timeline(run_dir / EVENTS_FILE, rank, attempt)
    except OSError as err:
        log.warning("cannot open %s (%s): this process records no events; training goes on",
                    run_dir / EVENTS_FILE, err.strerror or err)
        return
    record("start", at=started_at, world_size=world_size, host=socket.gethostname())


def record(kind: str, at: Optional[float] = None, **fields: Any) -> None:
    """Append an event to this process's timeline (nothing before `open_timeline`)."""
    if _timeline is not None:
        _timeline.record(kind, at, **fields)


def record_once(kind: str, at: Optional[float] = None, **fields: Any) -> None:
    """Rank 0 alone records it: what every rank does together, like a save, is one line
    per run, not one per rank (at 1,024 ranks the file would grow a thousand times as fast,
    and the report and the planner read rank 0's alone)."""
    if _timeline is not None and _timeline.rank == 0:
        _timeline.record(kind, at, **fields)


def progress(step: int) -> None:
    """Rank 0 alone records how far the run got (one line per log line, not per rank)."""
    record_once("progress", step=step)


def close() -> None:
    global _timeline
    if _timeline is not None:
        _timeline.close()
        _timeline = None


def describe_error(err: BaseException) -> str:
    """`Type: first line`, credentials out, short."""
    lines = str(err).strip().splitlines()
    text = strip_credentials(f"{type(err).__name__}: {lines[0] if lines else ''}")
    return text[:MAX_TEXT]


@contextmanager
def recording_exit() -> Iterator[None]:
    """Record how the process leaves the body: its exit code (0, a `SystemExit`'s code, or 1
    for any other exception, as `python -m train` maps them), and the error or preemption
    behind it as a `fault`; then close the timeline."""
    code, error = 0, None
    try:
        yield
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else 1
        error = exit_.__context__  # the error `raise SystemExit(code) from None` replaced
        raise
    except BaseException as err:
        code, error = 1, err
        raise
    finally:
        if isinstance(error, Preempted):
            record("fault", source="preemption", error=error.signal_name, step=error.step)
        elif code and error is not None and not isinstance(error, SystemExit):
            record("fault", source="exception", error=describe_error(error))
        record("exit", code=code)
        close()


# ---- reading ----

@dataclass(frozen=True)
class Event:
    kind: str
    time: float
    rank: int
    pid: int
    attempt: str
    restart: int
    fields: Dict[str, Any] = field(default_factory=dict)

    def __getitem__(self, name: str) -> Any:
        return self.fields[name]

    def get(self, name: str, default: Any = None) -> Any:
        return self.fields.get(name, default)


@dataclass(frozen=True)
class Events:
    """A run's events in time order, and how many lines could not be used."""

    events: List[Event]
    skipped: int
    truncated: bool = False  # more than MAX_EVENTS lines: the rest was not read


def _typed(value: Any, kind: type) -> bool:
    if kind is float:
        return (isinstance(value, (int, float)) and not isinstance(value, bool)
                and math.isfinite(value))
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool) and abs(value) < 2 ** 62
    return isinstance(value, str) and len(value) <= MAX_TEXT * 2


def parse_event(line: bytes) -> Optional[Event]:
    """The event a line holds, or None when it is not one of ours (any way at all)."""
    try:
        entry = json.loads(line)
    except (ValueError, RecursionError):
        return None
    if not isinstance(entry, dict) or entry.get("kind") not in KINDS:
        return None
    kind = entry["kind"]
    required = {**COMMON, **KINDS[kind]}
    if not all(name in entry and _typed(entry[name], t) for name, t in required.items()):
        return None
    optional = OPTIONAL.get(kind, {})
    if not all(_typed(entry[name], t) for name, t in optional.items() if name in entry):
        return None
    fields = {name: entry[name] for name in (*KINDS[kind], *optional) if name in entry}
    numbers = [entry[name] for name in ("rank", "pid", "restart", "time")] + [
        value for name, value in fields.items() if name in ("step", "to_step", "stall", "seconds")]
    if any(n < 0 for n in numbers):
        return None
    return Event(kind, float(entry["time"]), entry["rank"], entry["pid"], entry["attempt"],
                 entry["restart"], fields)


class EventStream:
    """The events of `path` in file order, one at a time, never holding more than one line
    (the report reads a month of events this way); once iterated, `skipped` counts the
    lines that are not events (blank lines are not: racing writers may leave one) and
    `lines` all the lines read."""

    def __init__(self, path: Path) -> None:
        self.path, self.skipped, self.lines = path, 0, 0

    def __iter__(self) -> Iterator[Event]:
        for line, whole in lines(self.path):
            self.lines += 1
            if whole and not line.strip():
                continue
            event = parse_event(line) if whole else None
            if event is None:
                self.skipped += 1
            else:
                yield event


def read_events(path: Path) -> Events:
    """The events in `path`, sorted by time, in a list (at most MAX_EVENTS lines: the
    whole file in memory; the report streams instead)."""
    events: List[Event] = []
    stream = EventStream(path)
    for event in stream:
        if stream.lines > MAX_EVENTS:
            return Events(sorted(events, key=lambda e: e.time), stream.skipped, truncated=True)
        events.append(event)
    return Events(sorted(events, key=lambda e: e.time), stream.skipped)


def wall_clock(perf_counter_mark: float) -> float:
    """The wall-clock time of a `time.perf_counter()` reading taken in this process."""
    return time.time() - (time.perf_counter() - perf_counter_mark)


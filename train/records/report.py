"""`python -m train.report RUN_DIR`: where a run's time went, as a table and a picture.

Prints a short table (goodput and its five parts; restarts, saves, failures) and writes
`RUN_DIR/goodput.png`: a stacked bar of the parts, and the run's timeline (steps done over
wall time, every attempt's start-up, checkpoints, failures, restarts, and the work that was
done again). Rank 0 also makes it at the end of every run, and logs the picture to MLflow.

Where the numbers come from: the five parts are read from `goodput.json`, what the run's
own accounting recorded (train/records/goodput.py), not recomputed from the events. The events mark
boundaries (a start, a save, a fault), not every step, so compute and data wait can only
come from the loop's own timing; a second computation would be a copy of goodput.py's rules
that could drift from them; and the table then says exactly what MLflow's `goodput` metrics
say. The events give the timeline and the counts, which goodput.json does not keep.

A crashed run's directory works too: attempts without an `exit` event end at their last
event (they died: killed, or still running), and a save staged but never committed is
drawn as cut short. Both files are input to distrust: what cannot be read is left out and
said so.

A month-long run at 1,024 ranks: the events are read one line at a time into a summary
per attempt, and the curves are thinned to a fixed number of points, so memory and the
time to draw stay bounded whatever the run's length and number of attempts; reading is
linear in the file.
"""

from __future__ import annotations

import argparse
import errno
import logging
import math
import sys
from array import array
from bisect import bisect_left
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Sequence, Set, Tuple

from common.files import atomic_file
from common.run_files import (EVENTS_FILE, GOODPUT_FILE, PARTS, PICTURE, GoodputTotals,
                              read_goodput)
from train.records.events import Event, EventStream

log = logging.getLogger(__name__)

COLORS = {"compute": "#2e7d32", "data_wait": "#1f77b4", "checkpoint_stall": "#f2a900",
          "restore": "#7b3fa0", "lost": "#c62828"}
MAX_POINTS = 2_000  # points of the steps-done curves drawn, all attempts together
MAX_MARKS = 1_000  # saves drawn per outcome; rollbacks kept whole per attempt
MAX_LABELLED = 12  # attempts drawn with text labels; a run of more gets the marks alone
FAULT_LABELS = {"health": "health: rolled back", "preemption": "preempted",
                "exception": "exception"}


class NotARun(ValueError):
    """The directory holds neither events.jsonl nor goodput.json."""


class Sampled:
    """An evenly thinned sample of a stream of (time, value) points, at most `cap` of them
    whatever the stream's length: every `stride`-th point is kept, and when `cap` are, every
    other one goes and the stride doubles. `count`: how many points came."""

    def __init__(self, cap: int) -> None:
        self.cap, self.stride, self.count = max(cap, 2), 1, 0
        self.times, self.values = array("d"), array("q")

    def add(self, t: float, value: int) -> None:
        if self.count % self.stride == 0:
            self.times.append(t)
            self.values.append(value)
            if len(self.times) >= self.cap:
                self.thin()
        self.count += 1

    def thin(self) -> None:
        self.times, self.values = self.times[::2], self.values[::2]
        self.stride *= 2

    def thin_to(self, cap: int) -> None:
        while len(self.times) > max(cap, 2):
            self.thin()

    def points(self) -> List[Tuple[float, int]]:
        return list(zip(self.times, self.values))


CURVE_KINDS = ("first_step", "progress", "save_staged", "rollback", "end")


@dataclass
class Attempt:
    """One start of the run's processes (all ranks of a round share its id), summed up from
    its events as they stream by: what the table and the picture need, in memory bounded
    by its world size and the caps above, not by how long it ran."""

    id: str
    first_time: float = math.inf  # its earliest event
    started: float = math.inf  # its earliest `start`
    last: float = -math.inf  # its latest event
    running: Set[int] = field(default_factory=set)  # ranks started, not (yet) exited
    exited_unstarted: Set[int] = field(default_factory=set)  # an exit read before its start
    rank0_exited: bool = False
    worst_exit: Optional[Tuple[int, float]] = None  # (code, time) of the largest |code|
    fault: Optional[Event] = None  # the first, of any rank
    preempted: bool = False
    # rank 0's:
    first_step: Optional[Event] = None
    end: Optional[Event] = None
    resumes: List[Event] = field(default_factory=list)
    rollbacks: List[Event] = field(default_factory=list)  # the first MAX_MARKS
    rollback_count: int = 0
    committed: Sampled = field(default_factory=lambda: Sampled(MAX_MARKS))
    failed: Sampled = field(default_factory=lambda: Sampled(MAX_MARKS))
    staged_open: Dict[int, float] = field(default_factory=dict)  # step: time, not landed
    landed_unstaged: Set[int] = field(default_factory=set)  # landed, staged not yet read
    steps: Sampled = field(default_factory=lambda: Sampled(MAX_POINTS))  # the curve's bulk
    latest: Optional[Tuple[float, int]] = None  # the curve's last point
    top: int = 0  # the curve's highest step
    alone: Optional[Event] = None  # ddp_ft: the steps this group trained alone at its end

    def add(self, e: Event) -> None:
        self.first_time, self.last = min(self.first_time, e.time), max(self.last, e.time)
        if e.kind == "start":
            self.started = min(self.started, e.time)
            if e.rank in self.exited_unstarted:
                self.exited_unstarted.discard(e.rank)
            else:
                self.running.add(e.rank)
        elif e.kind == "exit":
            if e.rank in self.running:
                self.running.discard(e.rank)
            else:
                self.exited_unstarted.add(e.rank)
            self.rank0_exited |= e.rank == 0
            worst = self.worst_exit
            if (worst is None or abs(e["code"]) > abs(worst[0])
                    or (abs(e["code"]) == abs(worst[0]) and e.time < worst[1])):
                self.worst_exit = (e["code"], e.time)
        elif e.kind == "fault":
            if self.fault is None or e.time < self.fault.time:
                self.fault = e
            self.preempted |= e["source"] == "preemption"
        if e.rank != 0:
            return
        if e.kind == "resume" and len(self.resumes) < MAX_MARKS:
            self.resumes.append(e)
        elif e.kind in ("save_committed", "save_failed"):
            if self.staged_open.pop(e["step"], None) is None:
                self.landed_unstaged.add(e["step"])
            (self.committed if e.kind == "save_committed" else self.failed).add(e.time, e["step"])
        elif e.kind == "alone":
            self.alone = e
        elif e.kind == "save_staged":
            if e["step"] in self.landed_unstaged:
                self.landed_unstaged.discard(e["step"])
            else:
                self.staged_open[e["step"]] = e.time
        if e.kind in CURVE_KINDS:
            self._on_curve(e)

    def _on_curve(self, e: Event) -> None:
        """Rank 0's first step, rollbacks (the first MAX_MARKS) and end are kept whole: the
        curve's corners; its progress in between is sampled."""
        if e.kind == "rollback":
            self.rollback_count += 1
            self._reached(e.time - e["seconds"], e["step"] - 1)
            self._reached(e.time, e["to_step"])
            if len(self.rollbacks) < MAX_MARKS:
                self.rollbacks.append(e)
            else:
                self.steps.add(e.time, e["to_step"])
            return
        step = e["step"] - 1 if e.kind == "first_step" else e["step"]
        self._reached(e.time, step)
        if e.kind == "first_step" and self.first_step is None:
            self.first_step = e
        elif e.kind == "end" and self.end is None:
            self.end = e
        else:
            self.steps.add(e.time, step)

    def _reached(self, t: float, step: int) -> None:
        self.top = max(self.top, step)
        if self.latest is None or t >= self.latest[0]:
            self.latest = (t, step)

    @property
    def start(self) -> float:
        return self.started if self.started < math.inf else self.first_time

    @property
    def exit_code(self) -> Optional[int]:
        """The worst exit code of its ranks; None when rank 0 left none (it died)."""
        if not self.rank0_exited or self.worst_exit is None:
            return None
        return self.worst_exit[0]

    @property
    def resumed_from(self) -> int:
        return min(self.resumes, key=lambda e: e.time)["step"] if self.resumes else 0

    def curve(self) -> List[Tuple[float, int]]:
        """(time, steps done) as rank 0 saw it, rollbacks as drops; at most about
        MAX_POINTS points however long the attempt ran."""
        points = self.steps.points()
        if self.first_step is not None:
            points.append((self.first_step.time, self.first_step["step"] - 1))
        for e in self.rollbacks:
            points += [(e.time - e["seconds"], e["step"] - 1), (e.time, e["to_step"])]
        if self.end is not None:
            points.append((self.end.time, self.end["step"]))
        if self.latest is not None:
            points.append(self.latest)
        points.sort(key=lambda p: p[0])  # stable: a rollback's two points stay in order
        return [p for i, p in enumerate(points) if i == 0 or p != points[i - 1]]


@dataclass
class Run:
    run_dir: Path
    books: Optional[GoodputTotals]  # goodput.json, checked; None when missing or unreadable
    books_problem: str  # why there are no books ("" when there are)
    attempts: List[Attempt]
    skipped: int = 0  # lines of events.jsonl that are not events

    @property
    def goodput(self) -> Optional[float]:
        if not self.books:
            return None
        total = sum(self.books.seconds.values())
        return self.books.seconds["compute"] / total if total else 0.0


def load_run(run_dir: Path) -> Run:
    """The run in `run_dir`, its events read one line at a time (a month of them at 1,024
    ranks is hundreds of MB)."""
    events_path, books_path = run_dir / EVENTS_FILE, run_dir / GOODPUT_FILE
    if not run_dir.is_dir() or not (events_path.is_file() or books_path.is_file()):
        raise NotARun(f"{run_dir} is not a run directory (it holds no {EVENTS_FILE} or "
                      f"{GOODPUT_FILE}): pass a run's directory, outputs/<run name> by "
                      f"default")
    books, problem = read_books(books_path)
    if not events_path.is_file():
        return Run(run_dir, books, problem, [])
    stream = EventStream(events_path)
    return Run(run_dir, books, problem, attempts_of(stream), stream.skipped)


def read_books(path: Path) -> Tuple[Optional[GoodputTotals], str]:
    """goodput.json's totals, checked, or None and why not."""
    if not path.is_file():
        return None, f"no {GOODPUT_FILE} (rank 0 never reached a log line)"
    return read_goodput(path)


def attempts_of(events: Iterable[Event]) -> List[Attempt]:
    """The attempts, in the order they started, from events in any order, taken one at a
    time; their curves thinned so that all of them together hold about MAX_POINTS."""
    by_id: Dict[str, Attempt] = {}
    for event in events:
        attempt = by_id.get(event.attempt)
        if attempt is None:
            attempt = by_id[event.attempt] = Attempt(event.attempt)
        attempt.add(event)
    attempts = sorted(by_id.values(), key=lambda a: a.start)
    for attempt in attempts:
        attempt.steps.thin_to(MAX_POINTS // max(len(attempts), 1))
    return attempts


# ---- the table ----

def seconds_text(s: float) -> str:
    if s < 120:
        return f"{s:.1f} s"
    return f"{s / 60:.1f} min" if s < 7200 else f"{s / 3600:.2f} h"


@dataclass(frozen=True)
class Counts:
    restarts: int
    committed: int
    failed_saves: int
    cut_short: int  # staged, never committed nor failed: killed mid-save
    failures: Dict[str, int]  # killed, exception, health, preemption


def counts(run: Run) -> Counts:
    failures = dict.fromkeys(("killed", "exception", "health", "preemption"), 0)
    landed = saves_of(run)
    for i, attempt in enumerate(run.attempts):
        failures["health"] += attempt.rollback_count
        cause = ending(attempt, last=i == len(run.attempts) - 1)
        if cause:
            failures[cause] += 1
    return Counts(max(len(run.attempts) - 1, 0), sum(s.committed for s in landed),
                  sum(s.failed for s in landed), sum(s.cut_short for s in landed), failures)


def ending(attempt: Attempt, last: bool) -> Optional[str]:
    """How an attempt failed, once per attempt (a killed rank's peers then fail too):
    killed (a rank left no exit, and the run went on), preemption or exception; None for
    a clean end, or for the last attempt while a rank of it may still be running."""
    if attempt.running:
        return None if last else "killed"
    if not attempt.exit_code:
        return None
    return "preemption" if attempt.preempted else "exception"


@dataclass(frozen=True)
class Landed:
    """An attempt's saves by rank 0, counted, and (time, step) points of each outcome to
    draw (committed, failed, cut short: at most about MAX_MARKS of each)."""

    committed: int
    failed: int
    cut_short: int  # staged, never committed nor failed: killed mid-save
    points: Dict[str, List[Tuple[float, int]]]


def saves_of(run: Run) -> List[Landed]:
    """Each attempt's saves. A process learns that a save committed in the background at
    its next step, so one killed before that left no record: a later attempt resuming
    from the step says it committed (drawn when it was staged)."""
    landed: List[Landed] = []
    resumed: Set[int] = set()  # the steps later attempts resumed from
    for attempt in reversed(run.attempts):
        staged = sorted((t, s) for s, t in attempt.staged_open.items())
        late = [(t, s) for t, s in staged if s in resumed]
        cut = [(t, s) for t, s in staged if s not in resumed]
        landed.append(Landed(attempt.committed.count + len(late), attempt.failed.count,
                             len(cut), {"committed": attempt.committed.points() + late,
                                        "failed": attempt.failed.points(),
                                        "cut short": cut}))
        resumed.add(attempt.resumed_from)
    return landed[::-1]


def table(run: Run) -> str:
    lines = [f"run {run.run_dir}"]
    if run.books:
        seconds = run.books.seconds
        total = sum(seconds.values())
        state = "" if run.books.ended else " (not ended: totals stop at the last log line)"
        lines.append(f"goodput {run.goodput:.1%} of {seconds_text(total)} accounted{state}")
        for part in PARTS:
            share = seconds[part] / total if total else 0.0
            lines.append(f"  {part.replace('_', ' '):<17}{seconds_text(seconds[part]):>11}"
                         f"{share:>8.1%}")
    else:
        lines.append(f"goodput unknown: {run.books_problem}")
    c = counts(run)
    failures = sum(c.failures.values())
    kinds = ", ".join(f"{k} {n}" for k, n in c.failures.items() if n)
    lines.append(f"restarts {c.restarts}   saves {c.committed} committed, {c.failed_saves} "
                 f"failed, {c.cut_short} cut short   failures {failures}"
                 + (f" ({kinds})" if kinds else ""))
    lines.append(status(run))
    alone = [a.alone for a in run.attempts if a.alone is not None]
    if alone:  # strategy=ddp_ft (train/recovery/replicas.py)
        lines.append(f"trained alone at the end: steps {alone[-1]['steps']} (no other replica "
                     f"group took part in them or after them: this group's final weights are "
                     f"its own)")
    if run.skipped:
        lines.append(f"{EVENTS_FILE}: {run.skipped} unreadable line(s) skipped")
    return "\n".join(lines)


def status(run: Run) -> str:
    if not run.attempts:
        return f"no {EVENTS_FILE}: no timeline (a run from before events were recorded)"
    last = run.attempts[-1]
    code = last.exit_code
    if code is not None:
        return f"last attempt exited with code {code}"
    if last.end is not None:
        return "last attempt trained to its last step"
    return "last attempt left no exit: killed, or still running"


# ---- the picture ----

def render(run: Run, out: Path) -> None:
    """Draw the picture into `out` (its format by its suffix, PNG without one), whole or
    not at all: a full disk or a signal mid-write keeps the previous picture. Raises
    ValueError for a format matplotlib cannot write, OSError when `out` cannot be written."""
    if out.exists() and not out.is_file():  # a device or a folder: never replaced
        raise OSError(errno.EINVAL, "not a regular file")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (bar, timeline) = plt.subplots(
        2, 1, figsize=(12, 6.5), gridspec_kw={"height_ratios": [1, 3.2], "hspace": 0.55})
    name = run.run_dir.resolve().name
    title = (f"{name}: goodput {run.goodput:.0%}" if run.goodput is not None
             else f"{name}: goodput unknown")
    c = counts(run)
    fig.suptitle(f"{title}   ·   {plural(c.restarts, 'restart')}, "
                 f"{plural(c.committed, 'checkpoint')}, "
                 f"{plural(sum(c.failures.values()), 'failure')}", fontsize=14,
                 fontweight="bold", parse_math=False)  # a `$` in a run name is no formula
    try:
        draw_bar(bar, run)
        draw_timeline(timeline, run)
        with atomic_file(out) as f:
            fig.savefig(f, format=out.suffix[1:].lower() or "png", dpi=100,
                        bbox_inches="tight")
    finally:
        plt.close(fig)


def plural(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def draw_bar(ax, run: Run) -> None:
    ax.set_yticks([])
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    if not run.books:
        ax.text(0.5, 0.5, f"goodput unknown: {run.books_problem}", ha="center", va="center",
                transform=ax.transAxes)
        ax.set_xticks([])
        return
    seconds = run.books.seconds
    total = sum(seconds.values()) or 1.0
    left = 0.0
    for part in PARTS:
        share = seconds[part] / total
        label = f"{part.replace('_', ' ')} {seconds_text(seconds[part])} ({share:.0%})"
        ax.barh(0, share, left=left, color=COLORS[part], label=label, height=0.6)
        if share > 0.09:
            ax.text(left + share / 2, 0, f"{part.replace('_', ' ')}\n{share:.0%}",
                    ha="center", va="center", color="white", fontsize=9, fontweight="bold")
        left += share
    ax.set_xlim(0, 1)
    ax.xaxis.set_major_formatter(lambda x, _: f"{x:.0%}")
    ax.set_title(f"where the {seconds_text(total)} went", loc="left", fontsize=11)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.35), ncol=5, frameon=False,
              fontsize=8.5, handlelength=1)


def time_axis(run: Run) -> Tuple[float, float, str]:
    """(origin, divisor, unit) for the timeline's x axis."""
    origin = run.attempts[0].start
    span = max(a.last for a in run.attempts) - origin
    if span < 300:
        return origin, 1.0, "s"
    return (origin, 60.0, "min") if span < 3 * 3600 else (origin, 3600.0, "h")


def restart_targets(run: Run) -> List[Tuple[float, int]]:
    """(time, step) where the run went back to a step: resumes and rollbacks."""
    targets = [(a.start, a.resumed_from) for a in run.attempts[1:]]
    targets += [(e.time, e["to_step"]) for a in run.attempts for e in a.rollbacks]
    return targets


class Floors:
    """The lowest step the run went back to at or after a time: work above it done before
    then was done again later."""

    def __init__(self, targets: Sequence[Tuple[float, int]]) -> None:
        ordered = sorted(targets)
        self.times = [t for t, _ in ordered]
        self.lowest: List[float] = []  # the minimum over targets[i:]
        for _, step in reversed(ordered):
            self.lowest.append(min(step, self.lowest[-1] if self.lowest else math.inf))
        self.lowest.reverse()

    def after(self, t: float) -> float:
        i = bisect_left(self.times, t)
        return self.lowest[i] if i < len(self.lowest) else math.inf


Polylines = Dict[str, List[List[Tuple[float, float]]]]


def draw_timeline(ax, run: Run) -> None:
    """Every attempt's curve, start-up, death and end; one collection per kind of mark, so
    the time to draw grows with neither the run's length nor its attempts; the text labels
    only for a run of at most MAX_LABELLED attempts."""
    from matplotlib.collections import LineCollection

    ax.set_ylabel("steps done")
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    if not run.attempts:
        ax.text(0.5, 0.5, status(run), ha="center", va="center", transform=ax.transAxes)
        ax.set_xticks([])
        ax.set_yticks([])
        return
    origin, unit, name = time_axis(run)
    x = lambda t: (t - origin) / unit  # noqa: E731
    ax.set_xlabel(f"wall time since the first start ({name})")
    floors = Floors(restart_targets(run))
    top = max([a.top for a in run.attempts] + [1])
    labelled = len(run.attempts) <= MAX_LABELLED
    lines: Polylines = {"count": [], "lost": [], "drop": []}
    restore: List[Tuple[float, float]] = []
    down: List[Tuple[float, float]] = []
    crosses: List[Tuple[float, float]] = []
    for i, attempt in enumerate(run.attempts):
        trained_from = attempt.first_step.time if attempt.first_step else attempt.last
        restore.append((x(attempt.start), x(trained_from)))
        curve = attempt.curve()
        trace(curve, floors, x, lines)
        y = (curve or [(0, 0)])[-1][1]
        nxt = run.attempts[i + 1] if i + 1 < len(run.attempts) else None
        died = attempt.exit_code is None and nxt is not None
        if died:
            down.append((x(attempt.last), x(nxt.start)))
            crosses.append((x(attempt.last), y))
        fault = attempt.fault if attempt.exit_code else None
        if fault is not None:
            crosses.append((x(fault.time), fault.get("step", y)))
        if labelled:
            label_attempt(ax, attempt, i, x, top, trained_from, y, died)
    spans(ax, restore, color=COLORS["restore"], alpha=0.18, lw=0,
          label="start-up and restore")
    if down:
        spans(ax, down, facecolor="none", hatch="////", edgecolor=COLORS["lost"], alpha=0.5,
              lw=0, label="down: no sign of life until the restart")
    styles = {"count": dict(colors=COLORS["compute"], lw=2.2),
              "lost": dict(colors=COLORS["lost"], lw=2.2),
              "drop": dict(colors=COLORS["lost"], lw=1.2, linestyles=":")}
    for kind, polylines in lines.items():
        ax.add_collection(LineCollection(polylines, **styles[kind]), autolim=False)
    ax.plot([], [], color=COLORS["compute"], lw=2.2, label="steps that count")
    ax.plot([], [], color=COLORS["lost"], lw=2.2, label="steps done again later")
    if crosses:
        ax.plot(*zip(*crosses), "X", ls="none", color=COLORS["lost"], ms=11, zorder=5)
    if not labelled:
        ax.text(1.0, 1.02, f"{len(run.attempts):,} attempts (labels left out above "
                f"{MAX_LABELLED})", transform=ax.transAxes, fontsize=8.5, color="#444",
                va="bottom", ha="right")
    draw_saves(ax, run, x)
    ax.set_ylim(0, top * 1.05)
    span = x(max(a.last for a in run.attempts)) or 1.0
    ax.set_xlim(-0.01 * span, span * 1.06)  # room for the last exit's label
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=4, fontsize=8.5,
              frameon=False)


def spans(ax, ranges: Sequence[Tuple[float, float]], **style) -> None:
    """Full-height bands over the x ranges (x0, x1): one collection for all of them."""
    from matplotlib.collections import PolyCollection

    boxes = [[(x0, 0), (x0, 1), (x1, 1), (x1, 0)] for x0, x1 in ranges]
    ax.add_collection(PolyCollection(boxes, transform=ax.get_xaxis_transform(), **style),
                      autolim=False)


def label_attempt(ax, attempt: Attempt, i: int, x, top: float, trained_from: float,
                  y: float, died: bool) -> None:
    """The text of one attempt: its number, resume, death, fault, rollbacks, exit."""
    ax.text(x(attempt.start), top * 1.07, f" attempt {i + 1}", fontsize=8.5, color="#444",
            va="bottom", ha="left", clip_on=False)
    for resume in attempt.resumes[:MAX_LABELLED]:
        ax.annotate(f"resumed at step {resume['step']}\n(load {resume['seconds']:.1f} s)",
                    (x(trained_from), resume["step"]), textcoords="offset points",
                    xytext=(-6, 6), ha="right", fontsize=8.5, color=COLORS["restore"])
    if died:
        ax.annotate("died (no exit)", (x(attempt.last), y), textcoords="offset points",
                    xytext=(4, 8), fontsize=8.5, color=COLORS["lost"])
    fault = attempt.fault if attempt.exit_code else None
    if fault is not None:
        ax.annotate(FAULT_LABELS.get(fault["source"], fault["source"]),
                    (x(fault.time), fault.get("step", y)), textcoords="offset points",
                    xytext=(4, 8), fontsize=8.5, color=COLORS["lost"], parse_math=False)
    for rollback in attempt.rollbacks[:MAX_LABELLED]:
        ax.annotate(f"rollback {rollback['step']}→{rollback['to_step']}",
                    (x(rollback.time), rollback["to_step"]), textcoords="offset points",
                    xytext=(4, -12), fontsize=8.5, color=COLORS["lost"])
    if attempt.exit_code is not None:
        ax.annotate(f"exit {attempt.exit_code}", (x(attempt.last), y),
                    textcoords="offset points", xytext=(4, -4), fontsize=8.5, color="#333")


def trace(points: Sequence[Tuple[float, int]], floors: Floors, x, lines: Polylines) -> None:
    """Add the curve to `lines`: "count" where the work counted, "lost" where it was done
    again later (a resume or rollback went back below it), "drop" for a rollback's fall."""
    def add(kind: str, a: Tuple[float, float], b: Tuple[float, float]) -> None:
        polylines = lines[kind]
        if polylines and polylines[-1][-1] == a:  # carry on the same line
            polylines[-1].append(b)
        else:
            polylines.append([a, b])

    for (t0, s0), (t1, s1) in zip(points, points[1:]):
        floor = floors.after(t1)
        if s1 < s0:
            add("drop", (x(t0), s0), (x(t1), s1))
        elif s1 <= floor or s0 >= floor:
            add("count" if s1 <= floor else "lost", (x(t0), s0), (x(t1), s1))
        else:
            tc = t0 + (t1 - t0) * (floor - s0) / (s1 - s0)  # where the work began to be lost
            add("count", (x(t0), s0), (x(tc), floor))
            add("lost", (x(tc), floor), (x(t1), s1))


def thinned(points: List[Tuple[float, int]], cap: int) -> List[Tuple[float, int]]:
    return points[::math.ceil(len(points) / cap)] if len(points) > cap else points


def draw_saves(ax, run: Run, x) -> None:
    saves: Dict[str, List[Tuple[float, int]]] = {"committed": [], "failed": [], "cut short": []}
    for landed in saves_of(run):
        for outcome, points in landed.points.items():
            saves[outcome] += points
    styles = [("committed", dict(marker="D", color=COLORS["compute"], ms=6),
               "checkpoint committed"),
              ("failed", dict(marker="x", color=COLORS["lost"], ms=9, mew=2), "save failed"),
              ("cut short", dict(marker="o", mfc="none", color=COLORS["checkpoint_stall"], ms=8,
                                 mew=1.8), "save cut short (never committed)")]
    for outcome, style, label in styles:
        points = thinned(sorted(saves[outcome]), MAX_MARKS)
        if points:
            ax.plot([x(t) for t, _ in points], [s for _, s in points], ls="none", zorder=4,
                    label=label, **style)


# ---- entry points ----

def write_run_report(run_dir: Path, tracker) -> None:
    """Rank 0 at the end of a run: log the table, draw the picture, attach it to the
    tracker's run. A report, not training: a failure here only warns."""
    try:
        run = load_run(run_dir)
        log.info("goodput report (python -m train.report %s):\n%s", run_dir, table(run))
        render(run, run_dir / PICTURE)
        tracker.log_artifact(run_dir / PICTURE)
    except Exception as err:  # noqa: BLE001  never fail a finished run over its report
        log.warning("cannot write the goodput report in %s (%s: %s); training is done",
                    run_dir, type(err).__name__, err)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m train.report",
                                     description="Where a run's time went: a table and "
                                                 "goodput.png.")
    parser.add_argument("run_dir", type=Path, help="the run's directory (outputs/<run name>)")
    parser.add_argument("--out", type=Path, help="where to write the picture (default: "
                                                 "RUN_DIR/goodput.png)")
    args = parser.parse_args(argv)
    try:
        run = load_run(args.run_dir)
    except NotARun as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except OSError as err:
        print(f"error: cannot read {args.run_dir} ({err.strerror or err}): check the path "
              f"and its permissions", file=sys.stderr)
        return 2
    print(table(run))
    out = args.out or args.run_dir / PICTURE
    try:
        render(run, out)
    except OSError as err:
        print(f"error: cannot write {out} ({err.strerror or err}): pass --out PATH to write "
              f"the picture elsewhere", file=sys.stderr)
        return 2
    except ValueError as err:  # matplotlib: "Format 'xyz' is not supported (...)"
        print(f"error: cannot write {out} ({err}): pass --out PATH ending in .png",
              file=sys.stderr)
        return 2
    print(f"picture: {out}")
    return 0


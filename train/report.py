"""`python -m train.report RUN_DIR`: where a run's time went, as a table and a picture.

Prints a short table (goodput and its five parts; restarts, saves, failures) and writes
`RUN_DIR/goodput.png`: a stacked bar of the parts, and the run's timeline (steps done over
wall time, every attempt's start-up, checkpoints, failures, restarts, and the work that was
done again). Rank 0 also makes it at the end of every run, and logs the picture to MLflow.

Where the numbers come from: the five parts are read from `goodput.json`, what the run's
own accounting recorded (train/goodput.py), not recomputed from the events. The events mark
boundaries (a start, a save, a fault), not every step, so compute and data wait can only
come from the loop's own timing; a second computation would be a copy of goodput.py's rules
that could drift from them; and the table then says exactly what MLflow's `goodput` metrics
say. The events give the timeline and the counts, which goodput.json does not keep.

A crashed run's directory works too: attempts without an `exit` event end at their last
event (they died: killed, or still running), and a save staged but never committed is
drawn as cut short. Both files are input to distrust: what cannot be read is left out and
said so.
"""

from __future__ import annotations

import argparse
import errno
import json
import logging
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from common.files import atomic_file
from train.events import EVENTS_FILE, Event, Events, read_events
from train.goodput import PARTS

log = logging.getLogger(__name__)

GOODPUT_FILE = "goodput.json"
PICTURE = "goodput.png"
MAX_BOOKS_BYTES = 1 << 16
COLORS = {"compute": "#2e7d32", "data_wait": "#1f77b4", "checkpoint_stall": "#f2a900",
          "restore": "#7b3fa0", "lost": "#c62828"}
FAULT_LABELS = {"health": "health: rolled back", "preemption": "preempted",
                "exception": "exception"}


class NotARun(ValueError):
    """The directory holds neither events.jsonl nor goodput.json."""


@dataclass
class Attempt:
    """One start of the run's processes (all ranks of a round share its id)."""

    id: str
    events: List[Event] = field(default_factory=list)

    @property
    def start(self) -> float:
        starts = [e.time for e in self.events if e.kind == "start"]
        return min(starts) if starts else self.events[0].time

    @property
    def last(self) -> float:
        return self.events[-1].time

    def of(self, kind: str, rank: Optional[int] = 0) -> List[Event]:
        return [e for e in self.events if e.kind == kind and (rank is None or e.rank == rank)]

    @property
    def exit_code(self) -> Optional[int]:
        """The worst exit code of its ranks; None when rank 0 left none (it died)."""
        if not self.of("exit"):
            return None
        return max((e["code"] for e in self.of("exit", None)), key=abs)

    @property
    def resumed_from(self) -> int:
        resumes = self.of("resume")
        return resumes[0]["step"] if resumes else 0

    def curve(self) -> List[Tuple[float, int]]:
        """(time, steps done) as rank 0 saw it, rollbacks as drops."""
        points: List[Tuple[float, int]] = []
        for e in self.of_any_step():
            if e.kind == "first_step":
                points.append((e.time, e["step"] - 1))
            elif e.kind == "rollback":
                points += [(e.time - e["seconds"], e["step"] - 1), (e.time, e["to_step"])]
            else:
                points.append((e.time, e["step"]))
        return points

    def of_any_step(self) -> List[Event]:
        kinds = ("first_step", "progress", "save_staged", "rollback", "end")
        return [e for e in self.events if e.rank == 0 and e.kind in kinds]


@dataclass
class Run:
    run_dir: Path
    books: Optional[Dict]  # goodput.json, checked; None when missing or unreadable
    books_problem: str  # why there are no books ("" when there are)
    events: Events
    attempts: List[Attempt]

    @property
    def goodput(self) -> Optional[float]:
        if not self.books:
            return None
        total = sum(self.books["seconds"].values())
        return self.books["seconds"]["compute"] / total if total else 0.0


def load_run(run_dir: Path) -> Run:
    events_path, books_path = run_dir / EVENTS_FILE, run_dir / GOODPUT_FILE
    if not run_dir.is_dir() or not (events_path.is_file() or books_path.is_file()):
        raise NotARun(f"{run_dir} is not a run directory (it holds no {EVENTS_FILE} or "
                      f"{GOODPUT_FILE}): pass a run's directory, outputs/<run name> by "
                      f"default")
    books, problem = read_books(books_path)
    events = read_events(events_path) if events_path.is_file() else Events([], 0)
    return Run(run_dir, books, problem, events, attempts_of(events.events))


def read_books(path: Path) -> Tuple[Optional[Dict], str]:
    """goodput.json's totals, checked, or None and why not."""
    if not path.is_file():
        return None, f"no {GOODPUT_FILE} (rank 0 never reached a log line)"
    try:
        with open(path, "rb") as f:
            books = json.loads(f.read(MAX_BOOKS_BYTES + 1)[:MAX_BOOKS_BYTES])
        seconds = {p: float(books["seconds"][p]) for p in PARTS}
        ended = bool(books.get("ended", False))
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError):
        return None, f"{GOODPUT_FILE} cannot be read"
    if not (all(s >= 0 for s in seconds.values()) and math.isfinite(sum(seconds.values()))):
        return None, f"{GOODPUT_FILE} holds impossible times"
    return {"seconds": seconds, "ended": ended}, ""


def attempts_of(events: List[Event]) -> List[Attempt]:
    """The attempts, in the order they started."""
    by_id: Dict[str, Attempt] = {}
    for event in events:  # sorted by time
        by_id.setdefault(event.attempt, Attempt(event.attempt)).events.append(event)
    return sorted(by_id.values(), key=lambda a: a.start)


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
    committed = failed = cut = 0
    for i, attempt in enumerate(run.attempts):
        landed = saves_of(run, i)
        committed += len(landed["committed"])
        failed += len(landed["failed"])
        cut += len(landed["cut short"])
        failures["health"] += len(attempt.of("rollback"))
        cause = ending(attempt, last=i == len(run.attempts) - 1)
        if cause:
            failures[cause] += 1
    return Counts(max(len(run.attempts) - 1, 0), committed, failed, cut, failures)


def ending(attempt: Attempt, last: bool) -> Optional[str]:
    """How an attempt failed, once per attempt (a killed rank's peers then fail too):
    killed (a rank left no exit, and the run went on), preemption or exception; None for
    a clean end, or for the last attempt while a rank of it may still be running."""
    silent = {e.rank for e in attempt.of("start", None)} - {e.rank for e in
                                                            attempt.of("exit", None)}
    if silent:
        return None if last else "killed"
    if not attempt.exit_code:
        return None
    preempted = any(e["source"] == "preemption" for e in attempt.of("fault", None))
    return "preemption" if preempted else "exception"


def saves_of(run: Run, i: int) -> Dict[str, List[Tuple[float, int]]]:
    """Attempt `i`'s saves by rank 0, as (time, step): committed, failed, cut short. A
    process learns that a save committed in the background at its next step, so one killed
    before that left no record: a later attempt resuming from the step says it committed
    (drawn when it was staged)."""
    attempt = run.attempts[i]
    resumed = {a.resumed_from for a in run.attempts[i + 1:]}
    committed = [(e.time, e["step"]) for e in attempt.of("save_committed")]
    failed = [(e.time, e["step"]) for e in attempt.of("save_failed")]
    landed = {s for _, s in committed + failed}
    staged = [(e.time, e["step"]) for e in attempt.of("save_staged") if e["step"] not in landed]
    committed += [(t, s) for t, s in staged if s in resumed]
    cut = [(t, s) for t, s in staged if s not in resumed]
    return {"committed": committed, "failed": failed, "cut short": cut}


def table(run: Run) -> str:
    lines = [f"run {run.run_dir}"]
    if run.books:
        seconds = run.books["seconds"]
        total = sum(seconds.values())
        state = "" if run.books["ended"] else " (not ended: totals stop at the last log line)"
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
    alone = [e for attempt in run.attempts for e in attempt.of("alone")]
    if alone:  # strategy=ddp_ft (train/ft.py)
        lines.append(f"trained alone at the end: steps {alone[-1]['steps']} (no other replica "
                     f"group took part in them or after them: this group's final weights are "
                     f"its own)")
    if run.events.skipped or run.events.truncated:
        lines.append(f"{EVENTS_FILE}: {run.events.skipped} unreadable line(s) skipped"
                     + ("; stopped reading at 1,000,000 lines" if run.events.truncated else ""))
    return "\n".join(lines)


def status(run: Run) -> str:
    if not run.attempts:
        return f"no {EVENTS_FILE}: no timeline (a run from before events were recorded)"
    last = run.attempts[-1]
    code = last.exit_code
    if code is not None:
        return f"last attempt exited with code {code}"
    if last.of("end"):
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
    seconds = run.books["seconds"]
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
    targets += [(e.time, e["to_step"]) for a in run.attempts for e in a.of("rollback")]
    return targets


def draw_timeline(ax, run: Run) -> None:
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
    targets = restart_targets(run)
    top = max([s for a in run.attempts for _, s in a.curve()] + [1])
    for i, attempt in enumerate(run.attempts):
        first = attempt.of("first_step")
        began = attempt.start
        trained_from = first[0].time if first else attempt.last
        ax.axvspan(x(began), x(trained_from), color=COLORS["restore"], alpha=0.18, lw=0,
                   label="start-up and restore" if i == 0 else None)
        ax.text(x(began), top * 1.07, f" attempt {i + 1}", fontsize=8.5, color="#444",
                va="bottom", ha="left", clip_on=False)
        draw_curve(ax, attempt.curve(), targets, x, first_legend=i == 0)
        for resume in attempt.of("resume"):
            ax.annotate(f"resumed at step {resume['step']}\n(load {resume['seconds']:.1f} s)",
                        (x(trained_from), resume["step"]), textcoords="offset points",
                        xytext=(-6, 6), ha="right", fontsize=8.5, color=COLORS["restore"])
        nxt = run.attempts[i + 1] if i + 1 < len(run.attempts) else None
        if attempt.exit_code is None and nxt is not None:
            ax.axvspan(x(attempt.last), x(nxt.start), facecolor="none", hatch="////",
                       edgecolor=COLORS["lost"], alpha=0.5, lw=0,
                       label="down: no sign of life until the restart" if not any(
                           a.exit_code is None for a in run.attempts[:i]) else None)
            y = (attempt.curve() or [(0, 0)])[-1][1]
            ax.plot(x(attempt.last), y, "X", color=COLORS["lost"], ms=11, zorder=5)
            ax.annotate("died (no exit)", (x(attempt.last), y), textcoords="offset points",
                        xytext=(4, 8), fontsize=8.5, color=COLORS["lost"])
        for fault in attempt.of("fault", None)[:1] if attempt.exit_code else []:
            y = fault.get("step", (attempt.curve() or [(0, 0)])[-1][1])
            ax.plot(x(fault.time), y, "X", color=COLORS["lost"], ms=11, zorder=5)
            ax.annotate(FAULT_LABELS.get(fault["source"], fault["source"]),
                        (x(fault.time), y), textcoords="offset points", xytext=(4, 8),
                        fontsize=8.5, color=COLORS["lost"], parse_math=False)
        for rollback in attempt.of("rollback"):
            ax.annotate(f"rollback {rollback['step']}→{rollback['to_step']}",
                        (x(rollback.time), rollback["to_step"]), textcoords="offset points",
                        xytext=(4, -12), fontsize=8.5, color=COLORS["lost"])
        if attempt.exit_code is not None:
            ax.annotate(f"exit {attempt.exit_code}", (x(attempt.last), (attempt.curve()
                        or [(0, 0)])[-1][1]), textcoords="offset points", xytext=(4, -4),
                        fontsize=8.5, color="#333")
    draw_saves(ax, run, x)
    ax.set_ylim(0, top * 1.05)
    span = x(max(a.last for a in run.attempts)) or 1.0
    ax.set_xlim(-0.01 * span, span * 1.06)  # room for the last exit's label
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=4, fontsize=8.5,
              frameon=False)


def draw_curve(ax, points: Sequence[Tuple[float, int]], targets: List[Tuple[float, int]],
               x, first_legend: bool) -> None:
    """Steps done over time: green where the work counted, red where it was done again
    later (a resume or rollback went back below it)."""
    for (t0, s0), (t1, s1) in zip(points, points[1:]):
        floor = min([s for t, s in targets if t >= t1], default=math.inf)
        if s1 < s0:  # a rollback's drop
            ax.plot([x(t0), x(t1)], [s0, s1], ":", color=COLORS["lost"], lw=1.2)
            continue
        if s1 <= floor or s0 >= floor:
            color = COLORS["compute"] if s1 <= floor else COLORS["lost"]
            ax.plot([x(t0), x(t1)], [s0, s1], color=color, lw=2.2)
            continue
        tc = t0 + (t1 - t0) * (floor - s0) / (s1 - s0)  # where the work began to be lost
        ax.plot([x(t0), x(tc)], [s0, floor], color=COLORS["compute"], lw=2.2)
        ax.plot([x(tc), x(t1)], [floor, s1], color=COLORS["lost"], lw=2.2)
    if first_legend:
        ax.plot([], [], color=COLORS["compute"], lw=2.2, label="steps that count")
        ax.plot([], [], color=COLORS["lost"], lw=2.2, label="steps done again later")


def draw_saves(ax, run: Run, x) -> None:
    committed, failed, cut = [], [], []
    for i in range(len(run.attempts)):
        saves = saves_of(run, i)
        committed += saves["committed"]
        failed += saves["failed"]
        cut += saves["cut short"]
    styles = [(committed, dict(marker="D", color=COLORS["compute"], ms=6),
               "checkpoint committed"),
              (failed, dict(marker="x", color=COLORS["lost"], ms=9, mew=2), "save failed"),
              (cut, dict(marker="o", mfc="none", color=COLORS["checkpoint_stall"], ms=8,
                         mew=1.8), "save cut short (never committed)")]
    for points, style, label in styles:
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


if __name__ == "__main__":
    raise SystemExit(main())

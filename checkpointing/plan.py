"""`python -m checkpointing.plan`: how often to checkpoint, by three models side by side.

Failures arrive at random with mean time between failures M (the whole job's: a per-GPU
MTBF divided by the number of GPUs). A checkpoint stalls the loop for C seconds; a failure
costs a restart of R seconds plus the work done since the last checkpoint. The interval t
(seconds of work between checkpoints) trades the two:

- Young (1974): t = sqrt(2CM), the first-order optimum.
- Daly (2006): t = sqrt(2CM)[1 + (1/3)sqrt(C/2M) + (1/9)(C/2M)] - C for C < 2M, else M.
- The exact exponential model: a segment of t work plus its C save, failures striking
  during work, save and restart alike, takes M e^(R/M) (e^((t+C)/M) - 1) expected wall time;
  goodput is t over that, maximized numerically. R scales the expected time by a constant,
  so it changes the goodput but not the best interval.

The common first-order goodput (1 + C/t + R/M)^-1 leaves out the work lost between the last
checkpoint and a failure: at C = 5 min, M = 186 min, R = 30 min, t = 43 min it says 78%
where the exact model says 67%. `simulate` (a seeded Monte-Carlo run of the same failure
process) checks the exact model.

    $ python -m checkpointing.plan --gpus 16384 --gpu-mtbf-hours 35064 \\
          --stall-seconds 300 --restart-seconds 1800
    $ python -m checkpointing.plan --from-run outputs/resnet     # C, R measured by a run

Exit code 0, or 2 with one line when the input is unusable.
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import yaml

from common.jsonl import records
from common.run_files import EVENTS_FILE, GOODPUT_FILE, read_goodput

HOUR = 3600.0
GOLDEN = (math.sqrt(5) - 1) / 2
Z99 = 2.576  # the two-sided 99% normal quantile: the simulator's confidence interval
# Inputs outside this range are typos (1e308 hours); inside it the model's sums stay finite
SMALLEST, LARGEST = 1e-9, 1e12


class PlanError(ValueError):
    """Input the planner cannot use; the message names the problem and the fix."""


# --- the models (all times in seconds) -------------------------------------------------

def cluster_mtbf(gpus: int, gpu_mtbf_seconds: float) -> float:
    """Independent GPUs, any one of which stops the job: the job's MTBF."""
    return gpu_mtbf_seconds / gpus


def young_interval(stall: float, mtbf: float) -> float:
    return math.sqrt(2 * stall * mtbf)


def daly_interval(stall: float, mtbf: float) -> float:
    if stall >= 2 * mtbf:
        return mtbf
    ratio = stall / (2 * mtbf)
    return young_interval(stall, mtbf) * (1 + math.sqrt(ratio) / 3 + ratio / 9) - stall


def expected_segment_seconds(work: float, stall: float, restart: float, mtbf: float) -> float:
    """Expected wall time to get `work` seconds done and saved (exponential failures)."""
    return mtbf * math.exp(restart / mtbf) * math.expm1((work + stall) / mtbf)


def exact_goodput(work: float, stall: float, restart: float, mtbf: float) -> float:
    try:
        return work / expected_segment_seconds(work, stall, restart, mtbf)
    except OverflowError:  # a restart or segment hundreds of MTBFs long: nothing gets done
        return 0.0


def first_order_goodput(work: float, stall: float, restart: float, mtbf: float) -> float:
    return 1 / (1 + stall / work + restart / mtbf)


def hopeless(save: float, mtbf: float) -> Optional[str]:
    """Why no checkpoint interval can help (a save of at least twice the MTBF), or None."""
    if save >= 2 * mtbf:
        return (f"a save of {duration(save)} is at least twice the MTBF ({duration(mtbf)}): "
                f"the job would fail more often than it saves")
    return None


def exact_optimum(stall: float, mtbf: float) -> float:
    """The interval that maximizes `exact_goodput` (restart-independent): golden-section
    search over (0, M], where the goodput is unimodal and the optimum lies."""
    # t / expm1((t+C)/M) times the constant e^(C/M), which overflows for a save of
    # hundreds of MTBFs (auto_interval with a tiny checkpoint.mtbf_hours): same argmax
    goodput: Callable[[float], float] = lambda t: t / (math.expm1(t / mtbf)
                                                       - math.expm1(-stall / mtbf))
    low, high = 0.0, mtbf
    for _ in range(200):
        if high - low <= 1e-9 * mtbf:
            break
        a, b = high - GOLDEN * (high - low), low + GOLDEN * (high - low)
        if goodput(a) < goodput(b):
            low = a
        else:
            high = b
    return (low + high) / 2


# --- the simulator ----------------------------------------------------------------------

@dataclass(frozen=True)
class Simulated:
    goodput: float
    low: float  # the 99% confidence interval of the goodput
    high: float


def simulated_segment(rng: random.Random, work: float, restart: float, mtbf: float) -> float:
    """Wall time of one segment: `work` (compute plus its save) is attempted until a
    failure-free stretch holds it; after each failure the restart and all of it again."""
    elapsed, needed = 0.0, work
    while True:
        failure = rng.expovariate(1 / mtbf)
        if failure >= needed:
            return elapsed + needed
        elapsed += failure
        needed = restart + work


def simulate(work: float, stall: float, restart: float, mtbf: float,
             segments: int = 20_000, seed: int = 0) -> Simulated:
    """Goodput of checkpointing every `work` seconds under seeded exponential failures."""
    rng = random.Random(seed)
    times = [simulated_segment(rng, work + stall, restart, mtbf) for _ in range(segments)]
    mean = statistics.fmean(times)
    half = Z99 * statistics.stdev(times) / math.sqrt(segments)
    return Simulated(work / mean, work / (mean + half), work / max(mean - half, 1e-300))


# --- the plan ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Measures:
    """What the plan needs. `stall`: how long a synchronous save blocks the loop (its whole
    duration); `async_stall`: how long an asynchronous save of the same state blocks it
    (None: not known, no async row)."""

    stall: float
    restart: float
    mtbf: float
    async_stall: Optional[float] = None
    step: Optional[float] = None  # seconds a training step takes: intervals in steps too


@dataclass(frozen=True)
class Row:
    mode: str  # "sync" or "async"
    stall: float
    method: str
    interval: float
    exact: float
    first_order: float
    floored: bool  # raised to the save's duration (async: one save at a time)


METHODS = (("Young sqrt(2CM)", young_interval), ("Daly 2006", daly_interval),
           ("exact optimum", exact_optimum))


def plan(m: Measures) -> List[Row]:
    """Young, Daly and the exact optimum for a synchronous save, then for an asynchronous
    one, whose interval can be no shorter than the save takes in the background."""
    modes = [("sync", m.stall, 0.0)]
    if m.async_stall is not None:
        modes.append(("async", m.async_stall, m.stall))
    rows = []
    for mode, stall, floor in modes:
        for name, interval in METHODS:
            t = interval(stall, m.mtbf)
            rows.append(Row(mode, stall, name, max(t, floor),
                            exact_goodput(max(t, floor), stall, m.restart, m.mtbf),
                            first_order_goodput(max(t, floor), stall, m.restart, m.mtbf),
                            floored=t < floor))
    return rows


def duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.3g} s"
    if seconds < 2 * HOUR:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / HOUR:.2f} h"


def table(m: Measures, rows: Sequence[Row]) -> str:
    lines = [f"MTBF M = {duration(m.mtbf)}, restart R = {duration(m.restart)}"
             + (f", step {duration(m.step)}" if m.step else ""),
             f"{'save':<6} {'stall C':>9}  {'method':<16} {'interval':>10}"
             + (f" {'steps':>8}" if m.step else "")
             + f"  {'goodput exact':>13}  {'first-order':>11}"]
    for r in rows:
        steps = f" {math.ceil(r.interval / m.step):>8,}" if m.step else ""
        note = "  (raised to the save's duration)" if r.floored else ""
        lines.append(f"{r.mode:<6} {duration(r.stall):>9}  {r.method:<16} "
                     f"{duration(r.interval):>10}{steps}  {r.exact:>13.1%}  "
                     f"{r.first_order:>11.1%}{note}")
    return "\n".join(lines)


# --- measures of a run ------------------------------------------------------------------

@dataclass(frozen=True)
class RunMeasures:
    save: float  # a save's whole duration: what a synchronous save would block
    stall: float  # how long the loop was blocked per save
    restart: Optional[float]  # a resumed process's start-up and load
    step: Optional[float]
    source: str


def usable(values: Iterable[object]) -> List[float]:
    """The numbers among `values` from 0 to LARGEST (the file is hostile input)."""
    return [float(v) for v in values if isinstance(v, (int, float))
            and not isinstance(v, bool) and 0 <= v <= LARGEST]


@dataclass
class RunEvents:
    """What the plan takes from rank 0's events (every rank records each resume): the
    saves' stalls and durations, and the processes' starts, first steps and resumes, as
    (pid, time, seconds); gathered in one pass over the file, in memory that grows with the
    saves and restarts alone."""

    stalls: List[object] = field(default_factory=list)
    saves: List[object] = field(default_factory=list)
    began: Dict[object, object] = field(default_factory=dict)  # pid: time of its start
    marks: Dict[str, List[Tuple[object, object, object]]] = field(
        default_factory=lambda: {"resume": [], "first_step": []})

    def add(self, r: Dict) -> None:
        if r.get("rank", 0) != 0:
            return
        kind = r.get("kind")
        if kind == "save_staged":
            self.stalls.append(r.get("stall"))
        elif kind == "save_committed":
            self.saves.append(r.get("seconds"))
        elif kind == "start":
            self.began[r.get("pid")] = r.get("time")
        elif kind in self.marks:
            self.marks[kind].append((r.get("pid"), r.get("time"), r.get("seconds")))

    def since_start(self, kind: str) -> List[float]:
        """For each rank-0 `kind` event: seconds since its process started (imports
        included); `seconds` of the event itself where that start is not recorded."""
        values: List[object] = []
        for pid, end, seconds in self.marks[kind]:
            start = self.began.get(pid)
            timed = all(isinstance(v, (int, float)) for v in (start, end))
            values.append(end - start if timed else seconds)
        return usable(values)


def from_events(run_dir: Path) -> Optional[RunMeasures]:
    """Medians over `RUN_DIR/events.jsonl` (train/records/events.py): each save staged (the stall)
    and committed (its whole duration), each resume; None when it holds no committed save."""
    path = run_dir / EVENTS_FILE
    if not path.is_file():
        return None
    events = RunEvents()
    # one line at a time (a month of events at 1,024 ranks is hundreds of MB); a huge
    # integer parses as inf, for `usable` to drop
    for record in records(path, parse_int=float):
        events.add(record)
    stalls, saves = usable(events.stalls), usable(events.saves)
    if not stalls or not saves:
        return None
    # A restart is a start-up plus a load: a run never resumed shows its start-up alone.
    restarts, what = events.since_start("resume"), "resumes"
    if not restarts:
        restarts, what = events.since_start("first_step"), "starts, no resume"
    return RunMeasures(statistics.median(saves), statistics.median(stalls),
                       statistics.median(restarts) if restarts else None,
                       step_seconds(run_dir), f"{path} ({len(saves)} saves, "
                                                f"{len(restarts)} {what})")


def step_seconds(run_dir: Path) -> Optional[float]:
    """Compute and data wait per counted step, from the run's goodput totals."""
    totals, _ = read_goodput(run_dir / GOODPUT_FILE)
    if totals is None or totals.counted_steps <= 0:
        return None
    busy = totals.seconds["compute"] + totals.seconds["data_wait"]
    return busy / totals.counted_steps if 0 < busy < math.inf else None


def measured_in(run_dir: Path) -> RunMeasures:
    if not run_dir.is_dir():
        raise PlanError(f"--from-run {run_dir} is not a directory: give a run directory "
                        f"(outputs/<run name>)")
    try:
        measures = from_events(run_dir)
    except OSError as err:
        raise PlanError(f"cannot read {run_dir / EVENTS_FILE} ({err.strerror or err}): "
                        f"check its permissions, or give --stall-seconds and "
                        f"--restart-seconds") from None
    if measures is None:
        raise PlanError(f"{run_dir} records no committed checkpoint save (no events.jsonl "
                        f"with save_staged and save_committed events): run it with "
                        f"checkpoint.enabled=true until it saves, or give --stall-seconds "
                        f"and --restart-seconds")
    return measures


def run_mtbf_hours(run_dir: Path) -> Optional[float]:
    """`checkpoint.mtbf_hours` of the run's latest composed config, if recorded."""
    try:
        config = yaml.safe_load((run_dir / ".hydra" / "latest" / "config.yaml").read_text())
        hours = float(config["checkpoint"]["mtbf_hours"])
    except (OSError, ValueError, KeyError, TypeError, yaml.YAMLError, RecursionError):
        return None
    return hours if SMALLEST <= hours <= LARGEST else None


# --- the command ------------------------------------------------------------------------

def positive(name: str, value: Optional[float]) -> Optional[float]:
    if value is not None and not SMALLEST <= value <= LARGEST:  # NaN too
        raise PlanError(f"{name}={value} must be a positive number from {SMALLEST:g} to "
                        f"{LARGEST:g}")
    return value


def given(value: Optional[float], measured: Optional[float]) -> Optional[float]:
    """The command line's value (even 0, to be refused), else the run's."""
    return measured if value is None else value


def mtbf_of(args: argparse.Namespace) -> float:
    """The job's MTBF in seconds: per-GPU MTBF / GPUs, or given whole, or the run's."""
    if (args.gpus is None) != (args.gpu_mtbf_hours is None):
        raise PlanError("--gpus and --gpu-mtbf-hours go together: give both, or "
                        "--mtbf-hours for the whole job")
    if args.gpus is not None:
        if args.mtbf_hours is not None:
            raise PlanError("give either --gpus with --gpu-mtbf-hours or --mtbf-hours, "
                            "not both")
        positive("--gpus", args.gpus)
        return cluster_mtbf(args.gpus, positive("--gpu-mtbf-hours", args.gpu_mtbf_hours) * HOUR)
    hours = args.mtbf_hours
    if hours is None and args.from_run is not None:
        hours = run_mtbf_hours(args.from_run)
    if hours is None:
        raise PlanError("no MTBF: give --gpus N --gpu-mtbf-hours H, or --mtbf-hours for the "
                        "whole job")
    return positive("--mtbf-hours", hours) * HOUR


def measures_of(args: argparse.Namespace) -> Measures:
    mtbf = mtbf_of(args)
    if args.from_run is not None:
        run = measured_in(args.from_run)
        print(f"measured in {run.source}: save {duration(run.save)}, stall "
              f"{duration(run.stall)}" + (f", restart {duration(run.restart)}"
                                          if run.restart else ""))
        restart = given(args.restart_seconds, run.restart)
        if restart is None:
            raise PlanError(f"{args.from_run} records no process start: give --restart-seconds")
        stall = given(args.stall_seconds, run.save)
        async_stall = given(args.async_stall_seconds, run.stall)
        step = given(args.step_seconds, run.step)
    else:
        if args.stall_seconds is None or args.restart_seconds is None:
            raise PlanError("give --stall-seconds and --restart-seconds, or --from-run "
                            "RUN_DIR")
        stall, restart = args.stall_seconds, args.restart_seconds
        async_stall, step = args.async_stall_seconds, args.step_seconds
    m = Measures(positive("--stall-seconds", stall), positive("--restart-seconds", restart),
                 mtbf, positive("--async-stall-seconds", async_stall),
                 positive("--step-seconds", step))
    if why := hopeless(m.stall, m.mtbf):
        raise PlanError(f"{why}; make saves faster (checkpoint.async_mode) or the job smaller")
    return m


def parse(argv: Optional[List[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m checkpointing.plan",
        description="The checkpoint interval by Young, Daly and the exact exponential "
                    "model, with each one's expected goodput (exact and first-order).")
    parser.add_argument("--gpus", type=int, help="GPUs in the job (with --gpu-mtbf-hours)")
    parser.add_argument("--gpu-mtbf-hours", type=float, help="mean time between failures "
                        "of one GPU, hours (4 years = 35064)")
    parser.add_argument("--mtbf-hours", type=float, help="the whole job's MTBF, hours "
                        "(instead of --gpus and --gpu-mtbf-hours)")
    parser.add_argument("--stall-seconds", type=float, help="C: how long a synchronous "
                        "save blocks training")
    parser.add_argument("--async-stall-seconds", type=float, help="how long an async save "
                        "of the same state blocks training (adds the async rows)")
    parser.add_argument("--restart-seconds", type=float, help="R: from a failure to "
                        "training again (detect, relaunch, load)")
    parser.add_argument("--step-seconds", type=float, help="a training step's time: show "
                        "intervals in steps")
    parser.add_argument("--from-run", type=Path, metavar="RUN_DIR", help="read C, R and "
                        "the step time measured by a run (its events.jsonl, goodput.json)")
    return parser.parse_args(argv)


def main(argv: Optional[List[str]] = None) -> int:
    args = parse(argv)
    try:
        measures = measures_of(args)
    except PlanError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(table(measures, plan(measures)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

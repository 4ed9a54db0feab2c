"""Measured goodput against the exact failure model, under real, randomly timed failures.

    python benchmarks/goodput_vs_model.py [--quick] [--nproc 1] [--mtbf 30] [--seed 0]

A pilot run (one SIGKILL through GOODPUT_FAULT) measures the save stall C, the restart R
and the step time; the planner (`checkpointing.plan.exact_optimum`) picks the interval for
them and the target MTBF M. Then one `torchrun --max-restarts` job per interval (a quarter
of the pick, the pick, four times it) trains the shapes dataset while this script SIGKILLs
a random rank at exponentially distributed wall-clock times (seeded, the same schedule for
every interval, mean `--mtbf` seconds), until the job's last step.

For each job it prints the goodput the run's own accounting measured (goodput.json) beside
the exact model's prediction from that job's own measures: C (mean stall per save), R (mean
time from a kill to the next first step, over kills not followed by another before it), M
(the job's wall time over its kills) and the step time. Two predictions:

- steady: f * t / E[segment], the model as the planner uses it (f: the share of a step's
  time that is compute, the rest being data wait; t: the interval's work);
- run: the same model applied to this job as it ran: its first start-up (no restart before
  it, but failures strike during it) and its last, partial segment are in the total too.

It draws both against the measured goodput into docs/goodput_vs_model.png (with --quick,
under the work directory). Absolute figures depend on the machine; the gaps do not.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import signal
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Sequence

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests")]

from checkpointing import plan  # noqa: E402
from data import synthetic  # noqa: E402
from support.launch import launch, torchrun, worker_pids  # noqa: E402
from train.records.events import EVENTS_FILE, read_events  # noqa: E402

BATCH = 20
IMAGES = 400  # 20 steps an epoch


@dataclass(frozen=True)
class Measured:
    """What one job measured, and the model's predictions from it."""

    interval: int  # steps between checkpoints
    steps: int
    kills: int
    crashes: int  # failures not injected (a rank's exception): M counts them too
    wall: float  # the first process's start to the last step
    stall: float  # C: mean stall per save
    restart: Optional[float]  # R: mean kill -> next first step (None: no clean restart)
    startup: float  # the first process's start -> its first step
    step: float  # compute + data wait per counted step
    compute_share: float  # f
    goodput: float  # measured: compute / everything accounted

    @property
    def mtbf(self) -> float:
        failures = self.kills + self.crashes
        return self.wall / failures if failures else math.inf

    def steady(self, restart: float) -> float:
        return self.compute_share * model_goodput(self.interval * self.step, self.stall,
                                                  restart, self.mtbf)

    def run(self, restart: float) -> float:
        """The model over this job: its first start-up, its full segments, its last one."""
        if math.isinf(self.mtbf):
            seconds = self.startup + self.steps * self.step + self.saves * self.stall
            return self.compute_share * self.steps * self.step / seconds
        m = self.mtbf
        full, rest = divmod(self.steps, self.interval)
        seconds = (plan.expected_segment_seconds(self.startup, 0.0,
                                                 max(restart - self.startup, 0.0), m)
                   + full * plan.expected_segment_seconds(self.interval * self.step,
                                                          self.stall, restart, m))
        if rest:
            seconds += plan.expected_segment_seconds(rest * self.step, self.stall, restart, m)
        return self.compute_share * self.steps * self.step / seconds

    @property
    def saves(self) -> int:
        return math.ceil(self.steps / self.interval)


def model_goodput(work: float, stall: float, restart: float, mtbf: float) -> float:
    if math.isinf(mtbf):
        return work / (work + stall)
    return plan.exact_goodput(work, stall, restart, mtbf)


# --- running a job ----------------------------------------------------------------------

def train_args(data: Path, run_root: Path, steps: int, interval: int) -> List[str]:
    """A tiny synchronous-checkpointing run: every save blocks for its whole duration, so
    C is what the model means by a stall. Validation only at the end (it counts as compute)."""
    epochs = math.ceil(steps * BATCH / IMAGES) + 1
    return ["-m", "train", f"data.root={data}", "data.image_size=32",
            f"data.global_batch_size={BATCH}", "data.num_workers=0", "model=tiny_cnn",
            "strategy=ddp", "strategy.timeout_seconds=20", "strategy.init_timeout_seconds=90",
            "logger=none", "trainer.device=cpu", f"trainer.max_steps={steps}",
            f"trainer.max_epochs={epochs}", f"trainer.val_every_epochs={epochs}",
            "trainer.log_every_steps=5", "checkpoint.async_mode=off",
            f"checkpoint.interval_steps={interval}", f"run.root={run_root}", "run.name=r"]


def ended(run_dir: Path) -> bool:
    path = run_dir / EVENTS_FILE
    return path.exists() and any(e.kind == "end" for e in read_events(path).events)


def inject_failures(job, run_root: Path, mtbf: float, rng: random.Random,
                    timeout: float) -> List[float]:
    """SIGKILL a random live rank at exponentially distributed times from the first rank's
    start (a failure that finds no rank alive, between two attempts, strikes the next one
    to start) until the job trains its last step. Returns the kill times."""
    kills: List[float] = []
    deadline = time.time() + timeout
    due = math.inf
    while job.poll() is None:
        if time.time() > deadline:
            os.killpg(job.pid, signal.SIGKILL)
            raise SystemExit(f"the job under {run_root} ran past {timeout:.0f}s: see its "
                             f"log")
        if math.isinf(due) and worker_pids(run_root):  # the failure clock starts with it
            due = time.time() + rng.expovariate(1 / mtbf)
        if time.time() < due:
            time.sleep(min(due - time.time(), 0.2))
            continue
        if ended(run_root / "r"):
            break
        pids = worker_pids(run_root)
        if not pids:
            time.sleep(0.02)
            continue
        os.kill(pids[rng.choice(sorted(pids))], signal.SIGKILL)
        kills.append(time.time())
        due = kills[-1] + rng.expovariate(1 / mtbf)
    return kills


def snapshot(work: Path) -> Path:
    """A copy of the trainer's packages and configs for the jobs to run (`python -m train`
    imports from its working directory first): a restart must not import a checkout that
    someone edits during the benchmark (one did here, and crashed on a half-made change)."""
    src = work / "src"
    for name in ("train", "data", "checkpointing", "common", "conf", "hydra_plugins"):
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, src / name,
                            ignore=shutil.ignore_patterns("__pycache__"))
    return src


def run_job(work: Path, name: str, data: Path, nproc: int, steps: int, interval: int,
            mtbf: float, seed: int, fault: str = "") -> Measured:
    run_root = work / name
    job = launch(torchrun(nproc, max_restarts=1000), train_args(data, run_root, steps, interval),
                 fault=fault, log=work / f"{name}.log", cwd=work / "src")
    kills = (inject_failures(job, run_root, mtbf, random.Random(seed), timeout=1200)
             if not fault else [])
    try:
        code = job.wait(timeout=120)  # it trained its last step: only the end is left
    except subprocess.TimeoutExpired:
        os.killpg(job.pid, signal.SIGKILL)
        code = job.wait()
    if code != 0:
        raise SystemExit(f"{name}: the job failed (exit {code}) after its last step: see "
                         f"{work / name}.log")
    run_dir = run_root / "r"
    if fault:  # the pilot: its one kill is the fault's, at the time its marker holds
        kills = [float(p.read_text()) for p in (run_dir / "faults").iterdir()]
    (run_root / "kills.json").write_text(json.dumps(kills))
    return measure(run_dir, kills, steps, interval)


def measure(run_dir: Path, kills: Sequence[float], steps: int, interval: int) -> Measured:
    """Its measures over what the accounting covers: from the first process's start (not
    torchrun's own, before it) to the last step."""
    events = [e for e in read_events(run_dir / EVENTS_FILE).events if e.rank == 0]
    books = json.loads((run_dir / "goodput.json").read_text())
    seconds = books["seconds"]
    busy = seconds["compute"] + seconds["data_wait"]
    began = min(e.time for e in events if e.kind == "start")
    firsts = [e.time for e in events if e.kind == "first_step"]
    end = next(e.time for e in events if e.kind == "end")
    crashes = sum(1 for e in events if e.kind == "fault" and e["source"] == "exception")
    return Measured(interval, steps, len(kills), crashes, end - began,
                    statistics.fmean([e["stall"] for e in events if e.kind == "save_staged"]),
                    clean_restart(kills, firsts), firsts[0] - began,
                    busy / books["counted_steps"], seconds["compute"] / busy,
                    seconds["compute"] / sum(seconds.values()))


def clean_restart(kills: Sequence[float], firsts: Sequence[float]) -> Optional[float]:
    """Mean time from a kill to the next first step, over the kills that no other kill
    followed before it (the model's R is a restart that no failure interrupts)."""
    restarts = []
    for n, kill in enumerate(kills):
        after = [t for t in firsts if t > kill]
        later = kills[n + 1] if n + 1 < len(kills) else math.inf
        if after and after[0] < later:
            restarts.append(after[0] - kill)
    return statistics.fmean(restarts) if restarts else None


# --- the report -------------------------------------------------------------------------

def table(rows: Sequence[Measured], restart: float, pick: int) -> str:
    lines = [f"{'interval':>14} {'kills':>5} {'M':>6} {'C':>7} {'R':>6} {'step':>7} "
             f"{'f':>5}  {'measured':>8} {'steady':>7} {'run':>7} {'meas-run':>8}"]
    for r in rows:
        r_used = r.restart or restart
        mark = " *" if r.interval == pick else ""
        lines.append(
            f"{r.interval:>5} = {r.interval * r.step:5.1f}s {r.kills:>5} {r.mtbf:5.1f}s "
            f"{r.stall:6.3f}s {r_used:5.1f}s {r.step * 1e3:5.1f}ms {r.compute_share:5.1%}  "
            f"{r.goodput:8.1%} {r.steady(r_used):7.1%} {r.run(r_used):7.1%} "
            f"{100 * (r.goodput - r.run(r_used)):+7.1f}p{mark}"
            + (f"  ({r.crashes} failure(s) not injected: see the job's log)"
               if r.crashes else ""))
    return "\n".join(lines)


def draw(rows: Sequence[Measured], restart: float, pick: int, out: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.4))
    step = statistics.fmean(r.step for r in rows)
    stall = statistics.fmean(r.stall for r in rows)
    mtbf = statistics.fmean(r.mtbf for r in rows)
    share = statistics.fmean(r.compute_share for r in rows)
    longest = max(r.interval for r in rows) * step * 1.6
    ts = [longest * (i + 1) / 200 for i in range(200)]
    left.plot(ts, [100 * share * model_goodput(t, stall, restart, mtbf) for t in ts],
              color="#888888", label=f"exact model (mean C {stall:.2f}s, R {restart:.1f}s, "
                                     f"M {mtbf:.0f}s)")
    xs = [r.interval * r.step for r in rows]
    left.scatter(xs, [100 * r.goodput for r in rows], color="#2e7d32", zorder=3,
                 label="measured (goodput.json)")
    left.scatter(xs, [100 * r.run(r.restart or restart) for r in rows], marker="x",
                 color="#c62828", zorder=3, label="model, each job's own C, R, M")
    left.axvline(pick * step, color="#1f77b4", linestyle=":", label="planner's pick")
    left.set(xlabel="checkpoint interval (seconds of work)", ylabel="goodput (%)",
             title="goodput against the interval")
    left.set_xscale("log")
    left.legend(fontsize=8, loc="lower center")
    predicted = [100 * r.run(r.restart or restart) for r in rows]
    measured = [100 * r.goodput for r in rows]
    low, high = min(predicted + measured) - 8, max(predicted + measured) + 8
    right.fill_between([low, high], [low - 5, high - 5], [low + 5, high + 5],
                       color="#dddddd", label="within 5 points")
    right.plot([low, high], [low, high], color="#888888")
    for r, p, m in zip(rows, predicted, measured):
        right.scatter(p, m, color="#2e7d32", zorder=3)
        right.annotate(f"{r.interval} steps", (p, m), textcoords="offset points",
                       xytext=(6, -4), fontsize=8)
    right.set(xlim=(low, high), ylim=(low, high), xlabel="predicted by the model (%)",
              ylabel="measured (%)", title="measured against predicted")
    right.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    print(f"picture: {out}")


# --- the benchmark ----------------------------------------------------------------------

def report(rows: Sequence[Measured], restart: float, pick: int,
           opts: argparse.Namespace) -> None:
    print(f"\n{opts.nproc} rank(s), tiny_cnn, {rows[0].steps} steps a job, failures every "
          f"{opts.mtbf:g}s on average (seed {opts.seed}); * = the planner's pick")
    print(table(rows, restart, pick))
    best = max(rows, key=lambda r: r.goodput)
    chosen = next(r for r in rows if r.interval == pick)
    print(f"planner's pick {pick} steps: measured {chosen.goodput:.1%}, best measured "
          f"{best.goodput:.1%} ({best.interval} steps)")


def measured_again(work: Path, mtbf: float) -> tuple:
    """(pilot, jobs) of a kept work directory, measured from its files again."""
    def of(run_root: Path, steps: int, interval: int) -> Measured:
        kills = json.loads((run_root / "kills.json").read_text())
        return measure(run_root / "r", kills, steps, interval)
    pilot = of(work / "pilot", 150, 10)
    jobs = sorted((p for p in work.glob("every*") if p.is_dir()),
                  key=lambda p: int(p.name[5:]))
    return pilot, [of(p, json.loads((p / "r" / "goodput.json").read_text())["reached"],
                      int(p.name[5:])) for p in jobs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a short smoke run: two "
                        "intervals, a few failures each, the picture under the work dir")
    parser.add_argument("--nproc", type=int, default=1, help="ranks per job")
    parser.add_argument("--mtbf", type=float, default=30.0, help="mean seconds between "
                        "injected failures")
    parser.add_argument("--work", type=float, default=150.0, help="seconds of training a "
                        "job would take without failures or saves")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "goodput_vs_model.png")
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    parser.add_argument("--again", type=Path, metavar="WORK_DIR", help="no jobs: the table "
                        "and picture again from a work directory this script left")
    opts = parser.parse_args()
    if opts.quick:
        opts.work, opts.mtbf = 30.0, 15.0
    if opts.again:
        pilot, rows = measured_again(opts.again, opts.mtbf)
        restart = pilot.restart or pilot.startup
        pick = max(1, round(plan.exact_optimum(pilot.stall, opts.mtbf) / pilot.step))
        report(rows, restart, pick, opts)
        draw(rows, restart, pick, opts.out)
        return

    work = Path(tempfile.mkdtemp(prefix="goodput-model-"))
    data = synthetic.generate(work / "data", IMAGES, 40, 32, seed=0, workers=1)
    snapshot(work)
    pilot = run_job(work, "pilot", data, opts.nproc, steps=150, interval=10,
                    mtbf=opts.mtbf, seed=opts.seed, fault="kill:rank=0:step=100")
    restart = pilot.restart or pilot.startup
    pick = max(1, round(plan.exact_optimum(pilot.stall, opts.mtbf) / pilot.step))
    steps = math.ceil(opts.work / pilot.step)
    print(f"pilot: C {pilot.stall:.3f}s a save, R {restart:.1f}s, step {pilot.step * 1e3:.1f}ms"
          f" -> planner's pick for M {opts.mtbf:g}s: {pick} steps "
          f"({pick * pilot.step:.1f}s; Young {plan.young_interval(pilot.stall, opts.mtbf):.1f}s)")
    intervals = [max(1, pick // 4), pick] if opts.quick else [max(1, pick // 4), pick, 4 * pick]
    rows = []
    for interval in intervals:
        rows.append(run_job(work, f"every{interval}", data, opts.nproc, steps, interval,
                            opts.mtbf, opts.seed))
        print(f"  {interval} steps: {rows[-1].kills} kills, measured {rows[-1].goodput:.1%}",
              flush=True)
    report(rows, restart, pick, opts)
    draw(rows, restart, pick, work / "goodput_vs_model.png" if opts.quick else opts.out)
    if not opts.keep:
        shutil.rmtree(work / "data")
        for interval in intervals:
            shutil.rmtree(work / f"every{interval}" / "r" / "checkpoints", ignore_errors=True)
    print(f"work directory: {work}")


if __name__ == "__main__":
    main()

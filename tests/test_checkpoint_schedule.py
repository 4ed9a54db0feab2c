"""When to checkpoint: a fixed interval, or the exact model's optimum (checkpointing.plan)
from the measured stall, save and step time and the configured MTBF."""

import logging
import math

from omegaconf import OmegaConf

from checkpointing import plan
from support.launch import run_train
from support.runs import FINAL, tiny_overrides
from support.logs import our_records
from train.resume.checkpoint import CheckpointSchedule


def cfg(**checkpoint):
    base = {"interval_steps": 10, "auto_interval": False, "mtbf_hours": 1.0,
            "restart_seconds": 60.0}
    return OmegaConf.create({"checkpoint": {**base, **checkpoint}})


class Clock:
    """`time.perf_counter` for the schedule: advanced by hand."""

    def __init__(self, monkeypatch):
        self.now = 0.0
        monkeypatch.setattr("train.resume.checkpoint.time.perf_counter", lambda: self.now)


def train_and_save(schedule, clock, steps, step_seconds, stall, save):
    """`steps` steps of `step_seconds`, then a save that blocks `stall` seconds."""
    clock.now += steps * step_seconds + stall
    schedule.saved(schedule.last_save_step + steps, stall_seconds=stall, save_seconds=save)


def test_fixed_interval_counts_from_the_resumed_step():
    schedule = CheckpointSchedule(cfg(), start_step=25)
    assert [s for s in range(26, 60) if schedule.due(s, final=False)] == list(range(35, 60))
    assert schedule.due(26, final=True)


def test_auto_interval_is_the_exact_models_optimum(monkeypatch):
    clock = Clock(monkeypatch)
    schedule = CheckpointSchedule(cfg(auto_interval=True), start_step=0)
    train_and_save(schedule, clock, steps=10, step_seconds=0.1, stall=0.5, save=2.0)
    # Young: sqrt(2 * 0.5 s * 3600 s) = 60 s = 600 steps; the exact optimum is shorter.
    assert schedule.interval == math.ceil(plan.exact_optimum(0.5, 3600) / 0.1) == 597


def test_auto_interval_is_never_shorter_than_a_save_takes(monkeypatch):
    clock = Clock(monkeypatch)
    schedule = CheckpointSchedule(cfg(auto_interval=True, mtbf_hours=0.01), start_step=0)
    train_and_save(schedule, clock, steps=10, step_seconds=0.1, stall=0.01, save=30.0)
    assert schedule.interval == 300  # 30 s of background save at 0.1 s a step


def test_a_hopeless_mtbf_is_said_once_with_the_planners_reason(monkeypatch, caplog):
    """A save of at least twice the MTBF: the planner refuses it, and the schedule says so
    once and keeps its interval, instead of a line at every save flipping between 1 and 2."""
    clock = Clock(monkeypatch)
    schedule = CheckpointSchedule(cfg(auto_interval=True, mtbf_hours=1e-6), start_step=0)
    with caplog.at_level(logging.INFO, logger="train.resume.checkpoint"):
        for i in range(12):  # step times jitter around the save's duration
            train_and_save(schedule, clock, steps=schedule.interval,
                           step_seconds=0.01 * (1 + i % 2), stall=0.005, save=0.015)
    lines = [r.getMessage() for r in caplog.records if r.name == "train.resume.checkpoint"]
    assert len(lines) == 1, lines
    assert lines[0].startswith("checkpoint.auto_interval: a save of ") and \
        "is at least twice the MTBF" in lines[0], lines
    assert schedule.interval == 10


def test_adjacent_intervals_of_one_or_two_steps_are_not_a_change(monkeypatch, caplog):
    clock = Clock(monkeypatch)
    schedule = CheckpointSchedule(cfg(auto_interval=True, interval_steps=1, mtbf_hours=0.1),
                                  start_step=0)
    with caplog.at_level(logging.INFO, logger="train.resume.checkpoint"):
        for i in range(12):  # the save's duration is one step or two
            train_and_save(schedule, clock, steps=1, step_seconds=1.0, stall=0.001,
                           save=1.0 + 0.9 * (i % 2))
    assert [r for r in caplog.records if r.name == "train.resume.checkpoint"] == []
    assert schedule.interval == 1


def test_auto_interval_settles_past_an_outlier_and_logs_changes_only(monkeypatch, caplog):
    """A slow first save moves the interval once; the medians of later, steady saves bring
    it back, and noise within 10% changes nothing and logs nothing."""
    clock = Clock(monkeypatch)
    schedule = CheckpointSchedule(cfg(auto_interval=True), start_step=0)
    caplog.set_level(logging.INFO, logger="train.resume.checkpoint")
    train_and_save(schedule, clock, steps=10, step_seconds=0.1, stall=8.0, save=9.0)
    slow = schedule.interval
    for stall in (0.5, 0.52, 0.48, 0.5, 0.51, 0.49):
        train_and_save(schedule, clock, steps=schedule.interval, step_seconds=0.1, stall=stall,
                       save=2.0)
    steady = math.ceil(plan.exact_optimum(0.5, 3600) / 0.1)
    assert slow > 3 * steady and abs(schedule.interval - steady) <= 0.1 * steady
    changes = [r.getMessage() for r in our_records(caplog) if "checkpoint interval" in r.message]
    assert 2 <= len(changes) <= 3, changes
    assert "exact model's optimum" in changes[-1] and "restart 60 s (assumed)" in changes[-1]


def test_a_resume_measures_the_restart_and_restarts_the_step_clock(monkeypatch, caplog):
    clock = Clock(monkeypatch)
    schedule = CheckpointSchedule(cfg(auto_interval=True), start_step=0)
    clock.now = 100.0  # start-up before the load: not training time
    schedule.resumed(40, restore_seconds=7.5)
    caplog.set_level(logging.INFO, logger="train.resume.checkpoint")
    train_and_save(schedule, clock, steps=10, step_seconds=0.1, stall=0.5, save=2.0)
    assert schedule.interval == 597
    expected = plan.exact_goodput(59.7, 0.5, 7.5, 3600)
    assert f"restart 7.5 s (measured at resume): expected goodput {expected:.1%}" in caplog.text


def test_a_fixed_interval_ignores_the_measures(monkeypatch):
    clock = Clock(monkeypatch)
    schedule = CheckpointSchedule(cfg(), start_step=0)
    train_and_save(schedule, clock, steps=10, step_seconds=0.1, stall=0.5, save=2.0)
    assert schedule.interval == 10


def test_a_real_run_re_picks_the_interval(tmp_path, tiny_root):
    """With a job MTBF of a million hours the first save (at checkpoint.interval_steps=2)
    makes the interval longer than the run: the only other save is the final one."""
    result = run_train([*tiny_overrides(tiny_root), "model=tiny_cnn", "logger=none",
                        "trainer.device=cpu", "checkpoint.interval_steps=2",
                        "checkpoint.auto_interval=true", "checkpoint.mtbf_hours=1e6",
                        f"run.root={tmp_path}", "run.name=r"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    saved = sorted(p.name for p in (tmp_path / "r" / "checkpoints").glob("step_*"))
    assert saved == ["step_000000002", FINAL]
    log = (tmp_path / "r" / "train.log").read_text()
    assert "checkpoint interval:" in log and "the exact model's optimum" in log

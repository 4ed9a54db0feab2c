"""The health checks and the fault-injection grammar, in one process (the multi-process
behaviour is in test_fault_tolerance.py)."""

from __future__ import annotations

import json
import math
import sys
import time

import pytest
import torch

from support.launch import run_job
from support.ledger import ledger_records
from support.runs import train_args
from train.config import HealthConfig
from train.errors import ConfigError, TrainingError
from train.faults import NO_FAULTS, FaultHook, Faults, parse
from train.records.goodput import Goodput
from train.recovery.health import HealthMonitor, HealthState, parameter_checksum


def monitor(tmp_path, **cfg) -> HealthMonitor:
    config = HealthConfig(**{"min_history": 3, "spike_factor": 5.0, "max_rollbacks": 1, **cfg})
    return HealthMonitor(config, HealthState(window=4), rank=0, run_dir=tmp_path,
                         replicated=False)


def check(m: HealthMonitor, step: int, loss: float, norm: float = 1.0):
    problem, stop = m.check_step(step, torch.tensor(loss, dtype=torch.float64),
                                 torch.tensor(norm))
    assert stop is False  # nobody asked to stop
    return problem


def test_spikes_are_judged_against_the_running_median(tmp_path):
    m = monitor(tmp_path)
    assert check(m, 1, 2.0) is None
    assert check(m, 2, 2.1) is None
    assert check(m, 3, 50.0) is None  # too little history yet to judge a spike
    assert check(m, 4, 1.9) is None  # window 2, 2.1, 50, 1.9: median 2.05
    assert check(m, 5, 10.2) is None  # under 5 x 2.05; the window drops 2.0
    assert check(m, 6, 10.9) is None  # median of 2.1, 50, 1.9, 10.2 is 6.15
    # Now 50, 1.9, 10.2, 10.9: median 10.55, so anything over 52.75 is a spike.
    assert check(m, 7, 60.0) == ("loss spike to 60 (over 5 x the running median) at step 7")
    assert list(m.state.losses) == [50.0, 1.9, 10.2, 10.9]  # a bad step is not remembered
    assert check(m, 8, 52.0) is None


def test_non_finite_loss_and_gradient_norm(tmp_path):
    m = monitor(tmp_path)
    assert check(m, 1, math.nan) == "non-finite loss at step 1"
    assert check(m, 2, 1.0, math.inf) == "non-finite gradient norm at step 2"
    assert check(m, 3, 1.0) is None


def test_skips_persist_and_rollbacks_are_capped(tmp_path):
    m = monitor(tmp_path)
    m.count_rollback()
    m.skip(7)
    assert m.skipped(7) and not m.skipped(8)
    assert json.loads((tmp_path / "health.json").read_text()) == {"skipped": [7]}
    fresh = monitor(tmp_path)
    fresh.load_skips(lambda skipped: skipped)  # a restart before the next checkpoint still skips step 7
    assert fresh.skipped(7)
    with pytest.raises(TrainingError, match="health.max_rollbacks=1"):
        m.count_rollback()


def test_state_round_trips_and_merges_skips(tmp_path):
    state = HealthState(window=3)
    state.losses.extend([1.5, 0.1 + 0.2])
    state.skip([4])
    other = HealthState(window=3)
    other.skip([9])
    other.load_state_dict(state.state_dict())
    assert list(other.losses) == [1.5, 0.1 + 0.2]  # bit for bit
    assert other.skipped == {4, 9}


def test_checksum_sees_a_single_flipped_bit():
    model = torch.nn.Linear(8, 4)
    before = parameter_checksum(model)
    with torch.no_grad():
        words = model.weight.view(-1).view(torch.int32)
        words[3] ^= 1  # the lowest mantissa bit: a float sum would barely notice
    assert not torch.equal(parameter_checksum(model), before)


def test_fault_grammar(tmp_path):
    faults = parse("kill:rank=1:step=5;nan:step=3;kill:save=2:phase=uploaded;omit:keys=rng")
    assert [(f.action, f.rank, f.step, f.save, f.phase) for f in faults] == [
        ("kill", 1, 5, None, None), ("nan", None, 3, None, None),
        ("kill", None, None, 2, "uploaded"), ("omit", None, None, None, None)]
    assert faults[-1].keys == ("rng",)
    with pytest.raises(ConfigError, match="cannot read 'explode:step=1' \\(unknown action"):
        parse("explode:step=1")
    with pytest.raises(ConfigError, match="unknown key"):
        parse("nan:stp=3")
    with pytest.raises(ConfigError, match="cannot read 'nan:step=three'"):
        parse("nan:step=three")


def loss_after(faults: FaultHook, step: int) -> float:
    loss = torch.tensor(1.0)
    faults.at("loss", step=step, loss=loss)
    return loss.item()


def test_a_fault_fires_once_per_run_unless_every(tmp_path, monkeypatch):
    once = Faults(parse("nan:step=2"), rank=0, marker_dir=tmp_path)
    assert loss_after(once, 1) == 1.0 and math.isnan(loss_after(once, 2))
    again = Faults(parse("nan:step=2"), rank=0, marker_dir=tmp_path)  # after a restart
    assert loss_after(again, 2) == 1.0
    other_rank = Faults(parse("nan:rank=1:step=2"), rank=0, marker_dir=tmp_path)
    assert loss_after(other_rank, 2) == 1.0
    every = Faults(parse("nan:step=2:every=1"), rank=0, marker_dir=tmp_path)
    assert math.isnan(loss_after(every, 2)) and math.isnan(loss_after(every, 2))
    monkeypatch.delenv("GOODPUT_FAULT", raising=False)
    assert Faults.from_env(0, tmp_path) is NO_FAULTS  # no GOODPUT_FAULT: the no-op hook


def test_goodput_moves_redone_steps_and_downtime_to_lost(tmp_path, monkeypatch):
    now = [0.0]  # seconds on a fake clock: perf_counter, and the wall clock 1000s ahead
    monkeypatch.setattr(time, "perf_counter", lambda: now[0])
    monkeypatch.setattr(time, "time", lambda: 1000 + now[0])
    first = Goodput(tmp_path / "goodput.json", process_start=0.0)
    first.started(0)
    for step in range(1, 5):  # 1s a step, 0.25s of it waiting for data
        now[0] = step
        first.step_done(step, data_wait=0.25, stall=0.0)
    first.save()  # ... and the process dies at 4, its last checkpoint at step 2
    now[0] = 9  # a new process started at 6 reaches its loop: 2s down, 3s of start-up
    second = Goodput(tmp_path / "goodput.json", process_start=6.0)
    second.started(2)  # steps 3 and 4 will be done again
    assert second.seconds == {"compute": 1.5, "data_wait": 0.5, "checkpoint_stall": 0.0,
                              "restore": 3.0, "lost": 2.0 + 2.0}
    assert second.metrics()["goodput"] == pytest.approx(1.5 / 9.0)
    now[0] = 10
    second.step_done(3, data_wait=0.25, stall=0.0)
    # Step 4 goes bad; the rollback to step 2 begins at 10.5 and is done at 11: step 3 was
    # in vain, and so was the half second of step 4.
    now[0] = 11
    second.rolled_back(bad_step=4, to_step=2, began=10.5)
    assert second.seconds == {"compute": 1.5, "data_wait": 0.5, "checkpoint_stall": 0.0,
                              "restore": 3.5, "lost": 5.5}
    second.save(ended=True)
    now[0] = 500  # a clean end: the time until the next run of the command is no one's
    assert Goodput(tmp_path / "goodput.json", process_start=499.0).seconds["lost"] == 5.5


def test_goodput_keeps_a_checkpointed_step_done_after_the_last_log_line(tmp_path, monkeypatch):
    """A crash after a checkpoint but before the next log line: the resumed process starts
    at that checkpoint, so the steps up to it are kept, not lost."""
    now = [0.0]
    monkeypatch.setattr(time, "perf_counter", lambda: now[0])
    monkeypatch.setattr(time, "time", lambda: 1000 + now[0])
    first = Goodput(tmp_path / "goodput.json", process_start=0.0)
    first.started(0)
    for step in range(1, 4):  # 1s a step; a log line after step 1, a checkpoint at step 3
        now[0] = step
        first.step_done(step, data_wait=0.0, stall=0.5 if step == 3 else 0.0)
        if step == 1:
            first.save()
    now[0] = 5  # dies at 4; a new process started at 4 reaches its loop at 5
    second = Goodput(tmp_path / "goodput.json", process_start=4.0)
    second.started(3)
    assert second.counted_steps == 3
    assert second.seconds == {"compute": 2.5, "data_wait": 0.0, "checkpoint_stall": 0.5,
                              "restore": 1.0, "lost": 1.0}


def written_totals(tmp_path) -> bytes:
    books = Goodput(tmp_path / "goodput.json", process_start=0.0)
    books.started(0)
    books.step_done(1, data_wait=0.0, stall=0.0)
    books.save()
    return (tmp_path / "goodput.json").read_bytes()


@pytest.mark.parametrize("damage", [
    lambda good: good[:len(good) // 2],  # a full disk or a kill cut it short
    lambda good: b"",
    lambda good: b"\xff\xfe not json",
    lambda good: b"[" * 100_000,  # deeper than the parser's stack
    lambda good: good.replace(b'"reached": 1', b'"reached": "1"'),
    lambda good: good.replace(b'"reached": 1', b'"reached": 1e400'),
    lambda good: good.replace(b'"compute": ', b'"compute": -1e308, "x": '),
    lambda good: b'{"seconds": {"compute": 1}, ' + b'"x": "' + b"a" * (1 << 20) + b'"}',
], ids=["truncated", "empty", "garbage", "deep", "string", "inf", "negative", "huge"])
def test_goodput_totals_an_earlier_process_left_damaged_start_again(tmp_path, caplog,
                                                                    damage):
    """The next process of a run starts with fresh totals and one warning; it trusted the
    file, and a truncated one stopped the start with a JSONDecodeError traceback."""
    (tmp_path / "goodput.json").write_bytes(damage(written_totals(tmp_path)))
    with caplog.at_level("WARNING", logger="train.records.goodput"):
        books = Goodput(tmp_path / "goodput.json", process_start=0.0)
    assert books.seconds == dict.fromkeys(books.seconds, 0.0) and books.reached == 0
    warned = [r.getMessage() for r in caplog.records if r.name == "train.records.goodput"]
    assert len(warned) == 1 and "start again from zero" in warned[0], warned


def test_a_bad_step_before_any_checkpoint_fails_once_then_is_skipped(tiny_root, tmp_path):
    """Nothing to roll back to: the process exits 1 with one line; the same command again
    (what torchrun --max-restarts does) starts afresh and skips that step's batch."""
    args = train_args(tiny_root, tmp_path, "trainer.max_steps=3", strategy="single")
    out = run_job([sys.executable], args, fault="nan:step=1", expect=1)
    assert "error: non-finite loss at step 1, and no checkpoint to roll back to: run the " \
           "same command again" in out and "Traceback" not in out
    assert not list((tmp_path / "r" / "checkpoints").glob("step_*"))
    run_job([sys.executable], args, fault="nan:step=1")  # fired already: it fires once
    records = ledger_records(tmp_path / "ledger.jsonl")
    assert [(r["step"], r.get("skipped", False)) for r in records] == [
        (1, True), (2, False), (3, False)]

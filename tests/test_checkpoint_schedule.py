"""When to checkpoint: a fixed interval, or Young/Daly from the measured stall and MTBF."""


from omegaconf import OmegaConf

from train.checkpoint import CheckpointSchedule


def cfg(**checkpoint):
    base = {"interval_steps": 10, "auto_interval": False, "mtbf_hours": 1.0}
    return OmegaConf.create({"checkpoint": {**base, **checkpoint}})


def test_fixed_interval_counts_from_the_resumed_step():
    schedule = CheckpointSchedule(cfg(), start_step=25)
    assert [s for s in range(26, 60) if schedule.due(s, final=False)] == list(range(35, 60))
    assert schedule.due(26, final=True)


def test_young_daly_interval_from_the_measured_stall(monkeypatch):
    clock = iter([0.0, 1.0])  # 10 steps took 1 s: 0.1 s a step
    monkeypatch.setattr("train.checkpoint.time.perf_counter", lambda: next(clock))
    schedule = CheckpointSchedule(cfg(auto_interval=True), start_step=0)
    schedule.saved(10, stall_seconds=0.5, save_seconds=2.0)
    # sqrt(2 * 0.5 s * 3600 s) = 60 s = 600 steps of 0.1 s
    assert schedule.interval == 600


def test_young_daly_never_asks_for_saves_faster_than_they_finish(monkeypatch):
    clock = iter([0.0, 1.0])
    monkeypatch.setattr("train.checkpoint.time.perf_counter", lambda: next(clock))
    schedule = CheckpointSchedule(cfg(auto_interval=True, mtbf_hours=1e-4), start_step=0)
    schedule.saved(10, stall_seconds=0.01, save_seconds=30.0)
    assert schedule.interval == 300  # 30 s of background save at 0.1 s a step

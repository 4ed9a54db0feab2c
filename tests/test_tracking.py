"""MLflow that cannot be used: at start one line and exit 2 on every rank; during a run a
warning, and training goes on with the metrics kept until the store answers again."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import subprocess
import sys
import time
from collections import deque
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from support.launch import free_port, run_train, train_env
from support.runs import tiny_overrides
from support.logs import our_records
from train.tracking import tracker as tracking
from train.config import LoggerConfig
from train.cluster.world import World
from train.errors import ConfigError
from train.tracking.sweep_run import (PARENT_ENV, SweepJob, SweepRun, current_sweep_job,
                                      open_experiment, record_best)
from train.tracking.tracker import MLflowTracker, Tracker, start_tracker


@pytest.fixture(autouse=True)
def mlflow_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tracker sets MLflow's HTTP settings in the environment: undo that after each test."""
    for name in {**tracking.CHECK_HTTP_SETTINGS, **tracking.RUN_HTTP_SETTINGS}:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)


@pytest.fixture(scope="module")
def store_uri(tmp_path_factory: pytest.TempPathFactory) -> str:
    """One sqlite store for the module: creating one takes seconds."""
    return f"sqlite:///{tmp_path_factory.mktemp('mlflow')}/m.db"


def dead_http_uri() -> str:
    return f"http://127.0.0.1:{free_port()}"  # nothing listens there


def test_a_tracking_server_nothing_listens_on_is_one_line_and_exit_2_in_seconds(
        tiny_root, tmp_path):
    began = time.monotonic()
    result = run_train(["+experiment=resnet", *tiny_overrides(tiny_root), "model=tiny_cnn",
                        "trainer.device=cpu", f"logger.tracking_uri={dead_http_uri()}",
                        f"run.root={tmp_path}"], cwd=tmp_path, timeout=240)
    took = time.monotonic() - began
    assert result.returncode == 2, result.stderr[-3000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: the MLflow tracking store"), lines
    assert "logger=none" in lines[0]
    assert took < 120, took  # MLflow's own retries took 257 s (this is mostly start-up)
    assert not list(tmp_path.rglob("checkpoints"))  # nothing was set up before the check


@pytest.mark.parametrize("uri", [
    "dead-server",
    "sqlite:////proc/goodput/mlflow.db",  # a folder no one (root included) can write in
    "sqlite:///{tmp}/a_file/mlflow.db",  # a path under a regular file
])
def test_the_start_check_names_a_store_that_cannot_be_used(uri: str, tmp_path: Path) -> None:
    (tmp_path / "a_file").write_text("not a folder")
    uri = dead_http_uri() if uri == "dead-server" else uri.format(tmp=tmp_path)
    began = time.monotonic()
    problem = MLflowTracker(LoggerConfig(tracking_uri=uri)).check()
    assert time.monotonic() - began < 30
    assert problem is not None and problem.startswith("the MLflow tracking store")
    assert "\n" not in problem and len(problem) < 600, problem


def test_every_rank_gets_rank_0s_verdict(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 1 has no tracker to check; it must still stop, not wait for rank 0 later."""
    verdict = "the MLflow tracking store http://h cannot be used (...)"
    monkeypatch.setattr(tracking, "broadcast_object", lambda obj, group: verdict)
    world = World(rank=1, world_size=2, local_rank=1, control_group=None)
    with pytest.raises(ConfigError, match="cannot be used"):
        start_tracker(LoggerConfig(tracking_uri="http://h"), world)
    monkeypatch.setattr(tracking, "broadcast_object", lambda obj, group: obj)
    assert type(start_tracker(LoggerConfig(), world)) is Tracker


def test_a_store_failing_mid_run_warns_once_and_catches_up(
        store_uri: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    uri = store_uri
    tracker = MLflowTracker(LoggerConfig(tracking_uri=uri))
    assert tracker.check() is None  # the start check passes a usable store
    calls = []

    def failing(*args, **kwargs):
        calls.append(1)
        raise OSError("database or disk is full")

    caplog.set_level(logging.INFO, logger="train.tracking.tracker")
    with tracker.run("r", OmegaConf.create({"a": 1})) as run_id:
        tracker.log_metrics({"train/loss": 1.0}, step=1)
        real_log_batch = tracker.client.log_batch
        monkeypatch.setattr(tracker.client, "log_batch", failing)
        for step in range(2, 6):  # the "training" goes on through the outage
            tracker.log_metrics({"train/loss": float(step)}, step=step)
        assert len(calls) == 1  # no new attempt before logger.retry_seconds: steps are not blocked
        monkeypatch.setattr(tracker.client, "log_batch", real_log_batch)
        monkeypatch.setattr(tracker, "retry_at", time.monotonic())  # logger.retry_seconds later
        tracker.log_metrics({"train/loss": 6.0}, step=6)
    warnings = [r.getMessage() for r in our_records(caplog) if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "training goes on" in warnings[0], warnings
    assert "kept in memory" in warnings[0] and "database or disk is full" in warnings[0]
    assert any("answers again: sent 5 kept" in r.getMessage() for r in our_records(caplog))

    from mlflow.tracking import MlflowClient
    client = MlflowClient(tracking_uri=uri)
    history = client.get_metric_history(run_id, "train/loss")
    assert sorted((m.step, m.value) for m in history) == [(s, float(s)) for s in range(1, 7)]
    assert client.get_run(run_id).info.status == "FINISHED"


def test_a_store_down_at_the_end_drops_what_is_pending_and_the_run_still_ends(
        store_uri: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    tracker = MLflowTracker(LoggerConfig(tracking_uri=store_uri))

    def failing(*args, **kwargs):
        raise OSError("connection refused")

    with tracker.run("r", OmegaConf.create({"a": 1})):
        monkeypatch.setattr(tracker.client, "log_batch", failing)
        monkeypatch.setattr(tracker.mlflow, "end_run", failing)
        tracker.log_metrics({"train/loss": 1.0, "train/lr": 0.1}, step=1)
    warnings = [r.getMessage() for r in our_records(caplog) if r.levelno == logging.WARNING]
    assert any("2 metric values, 0 files and the run's end (FINISHED) were not logged" in w
               for w in warnings), warnings


def test_a_store_failing_at_the_run_start_does_not_stop_training(
        store_uri: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    tracker = MLflowTracker(LoggerConfig(tracking_uri=store_uri))

    def failing(*args, **kwargs):
        raise OSError("disk I/O error")

    monkeypatch.setattr(tracker.mlflow, "start_run", failing)
    with tracker.run("r", OmegaConf.create({"a": 1})) as run_id:
        tracker.log_metrics({"train/loss": 1.0}, step=1)
    assert run_id is None
    warnings = [r.getMessage() for r in our_records(caplog) if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "training goes on" in warnings[0], warnings


@pytest.mark.parametrize("raised, status", [(None, "FINISHED"), ("preempted", "KILLED"),
                                            ("crash", "FAILED")])
def test_a_preempted_run_ends_killed_not_failed(store_uri: str, raised, status) -> None:
    """A preempted run goes on when it is requeued: MLflow must not show it as a failure."""
    from mlflow.tracking import MlflowClient

    from train.cluster.preemption import Preempted
    import mlflow
    mlflow.end_run()  # an earlier test's store failed at end_run: its run is still active
    tracker = MLflowTracker(LoggerConfig(tracking_uri=store_uri))
    error = {"preempted": Preempted("SIGTERM", 3, saved=True),
             "crash": RuntimeError("boom"), None: None}[raised]
    with pytest.raises(type(error)) if error else contextlib.nullcontext():
        with tracker.run("r", OmegaConf.create({"a": 1})) as run_id:
            if error:
                raise error
    assert MlflowClient(tracking_uri=store_uri).get_run(run_id).info.status == status


def test_a_sweep_parent_records_the_best_job_in_the_objective_s_direction(store_uri: str):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=store_uri)
    experiment_id = open_experiment(client, "sweep-test")
    assert client.get_experiment(experiment_id).tags["mlflow.experimentKind"] == \
        "custom_model_development"
    parent = client.create_run(experiment_id, run_name="sweep").info.run_id
    for number, loss in enumerate([0.5, 0.2, 0.2, 0.9]):  # job 1 and 2 tie: the first wins
        child = client.create_run(experiment_id, tags=SweepJob(parent, number, []).tags())
        client.log_metric(child.info.run_id, "val/loss", loss, step=3)
    record_best(client, parent, "val/loss", "minimize")
    run = client.get_run(parent)
    assert run.data.metrics["best/val/loss"] == 0.2 and run.data.tags["best.job"] == "1"
    record_best(client, parent, "val/loss", "maximize")
    assert client.get_run(parent).data.tags["best.job"] == "3"
    # A job that compared fewer runs writes a smaller step: it never hides the newer value.
    client.log_metric(parent, "best/val/loss", 0.5, step=2)
    assert client.get_run(parent).data.metrics["best/val/loss"] == 0.9


def test_a_sweep_whose_store_cannot_be_used_warns_and_its_jobs_log_alone(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture):
    (tmp_path / "a_file").write_text("not a folder")
    monkeypatch.delenv(PARENT_ENV, raising=False)
    config = OmegaConf.create({"logger": {"name": "mlflow", "experiment_name": "e",
                                          "tracking_uri": f"sqlite:///{tmp_path}/a_file/m.db"},
                               "sweep": {"objective": "val/top1", "direction": "maximize"}})
    SweepRun().on_multirun_start(config)
    assert PARENT_ENV not in os.environ
    assert any("no parent run for this sweep" in r.getMessage() for r in our_records(caplog))
    SweepRun().on_multirun_end(config)  # nothing to end, nothing raised
    assert current_sweep_job() is None  # and outside a Hydra multirun there is none anyway


def other_experiment_s_run(client) -> str:
    return client.create_run(open_experiment(client, "another-experiment")).info.run_id


def deleted_run(client) -> str:
    run_id = client.create_run(open_experiment(client, "goodput-trainer")).info.run_id
    client.delete_run(run_id)
    return run_id


@pytest.mark.parametrize("parent", [
    "garbage!", "x' OR 1=1 --", "a" * 9000, "ab\ncd", "0" * 32, other_experiment_s_run,
    deleted_run], ids=["garbage", "quote", "huge", "newline", "no-such-run", "other-experiment",
                       "deleted"])
def test_a_sweep_parent_that_is_no_live_run_here_is_one_warning_and_the_job_logs_alone(
        store_uri: str, parent, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """GOODPUT_SWEEP_PARENT_RUN_ID left in a shell, or mistyped: the job still logs all it has,
    as a run of its own, not as the child of a run that is not there (or is another's)."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=store_uri)
    parent = parent(client) if callable(parent) else parent
    monkeypatch.setattr(tracking, "current_sweep_job", lambda: SweepJob(parent, 0, ["a=1"]))
    tracker = MLflowTracker(LoggerConfig(tracking_uri=store_uri, system_metrics=False))
    with tracker.run("r", OmegaConf.create({"a": 1})) as run_id:
        tracker.log_metrics({"val/top1": 0.5}, step=1)
    warnings = [r.getMessage() for r in our_records(caplog)
                if r.levelno >= logging.WARNING and r.name.startswith("train")]
    assert len(warnings) == 1 and warnings[0].startswith(f"{PARENT_ENV}="), warnings
    assert "\n" not in warnings[0] and len(warnings[0]) < 600, warnings[0]
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.data.metrics == {"val/top1": 0.5}
    assert "mlflow.parentRunId" not in run.data.tags and "sweep.id" not in run.data.tags


def test_a_live_sweep_parent_gets_the_job_as_its_child(store_uri: str,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=store_uri)
    parent = client.create_run(open_experiment(client, "goodput-trainer")).info.run_id
    monkeypatch.setattr(tracking, "current_sweep_job", lambda: SweepJob(parent, 0, ["a=1"]))
    tracker = MLflowTracker(LoggerConfig(tracking_uri=store_uri, system_metrics=False))
    with tracker.run("r", OmegaConf.create({"a": 1})) as run_id:
        tracker.log_metrics({"val/top1": 0.5}, step=1)
    assert client.get_run(run_id).data.tags["mlflow.parentRunId"] == parent
    assert client.get_run(parent).data.metrics["best/val/top1"] == 0.5


@pytest.mark.parametrize("failing", ["set_experiment", "start_run", "log_params", "log_text"])
def test_a_start_that_fails_halfway_leaves_the_next_job_of_the_process_its_run(
        store_uri: str, failing: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The basic launcher runs a sweep's jobs in one process: a run left active by one job's
    failed start made every later job's start fail too ("already active"), logging nothing."""
    from mlflow.tracking import MlflowClient

    def fails(*args, **kwargs):
        raise OSError("disk I/O error")

    tracker = MLflowTracker(LoggerConfig(tracking_uri=store_uri, system_metrics=False))
    with monkeypatch.context() as patch:
        patch.setattr(tracker.mlflow, failing, fails)
        with tracker.run("first", OmegaConf.create({"a": 1})) as first:
            assert first is None
    tracker = MLflowTracker(LoggerConfig(tracking_uri=store_uri, system_metrics=False))
    with tracker.run("next", OmegaConf.create({"a": 1})) as run_id:
        tracker.log_metrics({"train/loss": 1.0}, step=1)
    assert run_id is not None
    assert MlflowClient(tracking_uri=store_uri).get_run(run_id).info.status == "FINISHED"


@pytest.mark.parametrize("dies_at", ["client", "get_run", "set_terminated"])
def test_a_store_that_died_mid_sweep_is_asked_briefly_at_the_sweep_s_end(
        dies_at: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture):
    """The sweep's own process never ran a job's tracker (joblib, submitit): without the start
    check's settings MLflow retried a dead server for minutes before the sweep could end."""
    seen = []

    class DeadStore:
        def __getattr__(self, name):
            seen.append({k: os.environ.get(k) for k in tracking.CHECK_HTTP_SETTINGS})
            if name == dies_at:
                raise ConnectionError("connection refused")
            return lambda *args, **kwargs: (
                OmegaConf.create({"info": {"experiment_id": "1"}}) if name == "get_run" else [])

    def client(uri):
        if dies_at == "client":
            seen.append({k: os.environ.get(k) for k in tracking.CHECK_HTTP_SETTINGS})
            raise ConnectionError("connection refused")
        return DeadStore()

    monkeypatch.setattr("train.tracking.sweep_run.mlflow_client", client)
    monkeypatch.setenv(PARENT_ENV, "0" * 32)
    config = OmegaConf.create({"logger": {"name": "mlflow", "tracking_uri": "http://h"},
                               "sweep": {"objective": "val/top1", "direction": "maximize"}})
    SweepRun().on_multirun_end(config)
    assert seen and all(s == tracking.CHECK_HTTP_SETTINGS for s in seen), seen
    warnings = [r.getMessage() for r in our_records(caplog) if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "was not completed" in warnings[0], warnings
    assert PARENT_ENV not in os.environ
    assert all(os.environ.get(k) is None for k in tracking.CHECK_HTTP_SETTINGS)


@pytest.mark.parametrize("logger", ["none", "mlflow"])
def test_a_parent_id_left_in_the_shell_is_not_the_new_sweep_s(
        logger: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "a_file").write_text("not a folder")
    monkeypatch.setenv(PARENT_ENV, "0" * 32)
    config = OmegaConf.create({"logger": {"name": logger, "experiment_name": "e",
                                          "tracking_uri": f"sqlite:///{tmp_path}/a_file/m.db"},
                               "sweep": {"objective": "val/top1", "direction": "maximize"}})
    SweepRun().on_multirun_start(config)
    assert PARENT_ENV not in os.environ


PARENT_AT_A_SIGNAL = """
import sys
from omegaconf import OmegaConf
from train.tracking.sweep_run import SweepRun, PARENT_ENV
import os
config = OmegaConf.create({"logger": {"name": "mlflow", "experiment_name": "e",
                                      "tracking_uri": sys.argv[1]},
                           "sweep": {"objective": "val/top1", "direction": "maximize"}})
print("ready", flush=True)
sys.stdin.readline()
SweepRun().on_multirun_start(config)
print("parent", os.environ.get(PARENT_ENV), flush=True)
"""


def test_two_sweeps_started_at_once_into_a_new_sqlite_store_both_get_their_parent(
        tmp_path: Path) -> None:
    """Both sweeps' callbacks open the new store in the same instant (released together once
    both have imported MLflow): each ran the schema migrations ("duplicate column name")."""
    store = f"sqlite:///{tmp_path}/mlflow.db"
    procs = [subprocess.Popen([sys.executable, "-c", PARENT_AT_A_SIGNAL, store],
                              env=train_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    for proc in procs:
        assert proc.stdout.readline().strip() == "ready"
    for proc in procs:
        proc.stdin.write("go\n")
        proc.stdin.flush()
    outs = [proc.communicate(timeout=120) for proc in procs]
    parents = [out.split()[-1] for out, _ in outs]
    assert all(len(p) == 32 for p in parents), outs
    from mlflow.tracking import MlflowClient
    client = MlflowClient(tracking_uri=store)
    assert {client.get_run(p).info.run_name.startswith("sweep-") for p in parents} == {True}


def config_names_store(run_dir: Path, uri: str) -> Path:
    """The run's own config (Hydra's record) naming `uri`: `python -m train.unsent` trusts
    the store a file names only when the run's config names it too."""
    (run_dir / ".hydra").mkdir(exist_ok=True)
    config = run_dir / ".hydra" / "config.yaml"
    config.write_text(f"logger:\n  tracking_uri: {uri}\n")
    return config


def test_python_m_train_unsent_sends_what_was_kept_and_ends_the_run_as_it_ended(
        store_uri: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture) -> None:
    """The documented command, on a file that also holds what an attacker or a crash would
    leave: a torn line, paths outside the run directory, a huge line, values of wrong types."""
    from mlflow.tracking import MlflowClient

    from train.tracking import unsent

    client = MlflowClient(tracking_uri=store_uri)
    run_id = client.create_run(open_experiment(client, "goodput-trainer")).info.run_id
    (tmp_path / "goodput.json").write_text("{}")
    (tmp_path.parent / "secret.txt").write_text("not the run's")
    (tmp_path / "notes.txt").symlink_to(tmp_path.parent / "secret.txt")  # a link out
    kept = unsent.Unsent(uri=store_uri)
    kept.add_metrics(run_id, [("train/loss", 1.0 / s, 1_000 + s, s) for s in range(1, 2501)])
    kept.artifacts.append((run_id, "goodput.json"))
    kept.models.append(run_id)
    kept.ends[run_id] = ("KILLED", 987_654)
    path = tmp_path / unsent.FILE
    unsent.write(path, kept)
    unsent.append(path, [{"run": run_id, "artifact": "../secret.txt"},
                         {"run": run_id, "artifact": "notes.txt"},
                         {"run": run_id, "artifact": str(tmp_path.parent / "secret.txt")},
                         {"run": run_id, "metric": ["x", "NaN-string", 1, 1]},
                         {"run": "x' OR 1=1 --", "end": ["FINISHED", 1]},
                         {"run": run_id, "end": ["RUNNING", 5]},
                         {"run": run_id, "metric": ["y" * 3000, 1.0, 1, 1]}])
    with open(path, "a") as f:
        f.write('{"run": "' + run_id + '", "metric": ["train/loss", 9.0, 1')  # torn
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    # the file alone does not choose the store: the run's own config must name it too
    config_names_store(tmp_path, "http://elsewhere.example:5000")
    assert unsent.main([str(tmp_path)]) == 2
    assert "which the run's own config" in capsys.readouterr().err and path.exists()
    config_names_store(tmp_path, store_uri)
    assert unsent.main([str(tmp_path)]) == 0  # the store the file and the config name
    out = capsys.readouterr().out
    assert "sent 2500 metric values" in out and "launch the run again" in out
    history = client.get_metric_history(run_id, "train/loss")
    assert sorted((m.step, m.value, m.timestamp) for m in history) == [
        (s, 1.0 / s, 1_000 + s) for s in range(1, 2501)]
    run = client.get_run(run_id)
    assert (run.info.status, run.info.end_time) == ("KILLED", 987_654)
    assert set(run.data.metrics) == {"train/loss"}
    assert [a.path for a in client.list_artifacts(run_id)] == ["goodput.json"]
    assert not path.exists()
    assert unsent.main([str(tmp_path)]) == 0 and "nothing unsent" in capsys.readouterr().out
    assert unsent.main([str(tmp_path / "typo")]) == 2
    assert "is no directory" in capsys.readouterr().err


def test_python_m_train_unsent_keeps_the_file_while_the_store_is_down(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """A dead server: one line and exit 1 within the subprocess's timeout under MLflow's
    default HTTP settings (its own retries took 4 minutes); a URI MLflow cannot open at all:
    one line and exit 2. The file stays as it was."""
    from train.tracking import unsent

    kept = unsent.Unsent(uri="http://u:pw@nowhere")
    kept.add_metrics("a" * 32, [("train/loss", 1.0, 1, 1)])
    unsent.write(tmp_path / unsent.FILE, kept)
    before = (tmp_path / unsent.FILE).read_bytes()
    assert b"pw" not in before  # the file never holds the store's credentials
    dead = dead_http_uri().replace("http://", "http://user:s3cret@")
    result = subprocess.run([sys.executable, "-m", "train.unsent", str(tmp_path),
                             "--tracking-uri", dead], env=train_env(), capture_output=True,
                            text=True, timeout=90)
    err = result.stderr.strip().splitlines()
    assert result.returncode == 1 and len(err) == 1, result.stderr[-3000:]
    assert "1 of 1 metric values still unsent" in err[0] and "s3cret" not in err[0], err
    for uri in ("foo://user:s3cret@host", str(tmp_path / "not-a-store")):
        assert unsent.main([str(tmp_path), "--tracking-uri", uri]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "fix --tracking-uri" in err[0] and "s3cret" not in err[0], err
    assert (tmp_path / unsent.FILE).read_bytes() == before


def test_the_unsent_file_stays_bounded(tmp_path: Path) -> None:
    from train.tracking import unsent

    kept = unsent.Unsent()
    kept.add_metrics("a" * 32, [("m", float(i), i, i) for i in range(unsent.MAX_METRICS + 7)])
    assert len(kept.metrics) == unsent.MAX_METRICS and kept.dropped == 7
    assert kept.metrics[0][1][3] == 7  # the oldest went
    unsent.write(tmp_path / unsent.FILE, kept)
    unsent.append(tmp_path / unsent.FILE, [{"run": "a" * 32, "metric": ["m", 1.0, 1, 1]}] * 9)
    again = unsent.read(tmp_path / unsent.FILE)
    assert len(again.metrics) == unsent.MAX_METRICS and again.metrics[-1][1] == ("m", 1.0, 1, 1)


def test_python_m_train_unsent_leaves_a_live_run_alone(
        store_uri: str, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """Run beside the trainer that kept the file (its store down), it ended that live run
    FAILED and sent what the trainer sends again itself: refused, one line, exit 2."""
    from mlflow.tracking import MlflowClient

    from train.tracking import unsent
    from train.cluster.runlock import LOCK_FILE

    client = MlflowClient(tracking_uri=store_uri)
    run_id = client.create_run(open_experiment(client, "goodput-trainer")).info.run_id
    kept = unsent.Unsent(uri=store_uri)
    kept.add_metrics(run_id, [("train/loss", 1.0, 1, 1)])
    unsent.write(tmp_path / unsent.FILE, kept)
    config_names_store(tmp_path, store_uri)
    before = (tmp_path / unsent.FILE).read_bytes()
    holder = subprocess.Popen(  # a trainer's lock, as rank 0 holds it once started
        [sys.executable, "-c", "import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_RDWR | "
         "os.O_CREAT); fcntl.lockf(fd, fcntl.LOCK_SH); print('held', flush=True); "
         "sys.stdin.read()", str(tmp_path / LOCK_FILE)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        assert unsent.main([str(tmp_path)]) == 2
        # ours, not MLflow's own INFO lines (a new store's tables, when this test runs first)
        err = [line for line in capsys.readouterr().err.splitlines()
               if "mlflow.store" not in line]
        assert len(err) == 1 and "is live" in err[0], err
    finally:
        holder.communicate("")
    assert (tmp_path / unsent.FILE).read_bytes() == before
    assert client.get_run(run_id).info.status == "RUNNING"
    assert unsent.main([str(tmp_path)]) == 0  # its trainer gone: sent, and ended
    assert client.get_run(run_id).info.status == "FAILED"


def test_what_the_store_refuses_is_dropped_not_kept_to_fail_every_send(
        store_uri: str, tmp_path: Path, capsys: pytest.CaptureFixture,
        caplog: pytest.LogCaptureFixture) -> None:
    """A metric name MLflow does not allow, a run deleted meanwhile: each was kept and sent
    again forever, and every value after it waited behind it
    (the run's own, and its end), as if the store were down for good."""
    from mlflow.tracking import MlflowClient

    from train.tracking import unsent

    client = MlflowClient(tracking_uri=store_uri)
    experiment = open_experiment(client, "goodput-trainer")
    live, deleted = (client.create_run(experiment).info.run_id for _ in range(2))
    client.delete_run(deleted)
    nowhere = "f" * 32
    kept = unsent.Unsent(uri=store_uri)
    kept.add_metrics(live, [("train/loss", 1.0, 1_000, 1), ("bad!name", 2.0, 1_001, 1),
                            ("train/loss", 3.0, 1_002, 2)])
    for run in (deleted, nowhere):
        kept.add_metrics(run, [("train/loss", 1.0, 1_000, 1)])
        kept.ends[run] = ("FINISHED", 2_000)
    kept.ends[live] = ("FINISHED", 3_000)
    config_names_store(tmp_path, store_uri)
    unsent.write(tmp_path / unsent.FILE, kept)
    before = (tmp_path / unsent.FILE).read_bytes()
    # a run the store never had: most likely the wrong store, so nothing is dropped
    assert unsent.main([str(tmp_path)]) == 2
    err = [line for line in capsys.readouterr().err.splitlines()  # MLflow's own: INFO
           if not line.startswith(time.strftime("%Y/"))]
    assert len(err) == 1 and nowhere in err[0] and "--tracking-uri" in err[0], err
    assert (tmp_path / unsent.FILE).read_bytes() == before
    kept.metrics = deque(item for item in kept.metrics if item[0] != nowhere)
    del kept.ends[nowhere]
    unsent.write(tmp_path / unsent.FILE, kept)
    with caplog.at_level(logging.WARNING, logger="train.tracking.unsent"):
        assert unsent.main([str(tmp_path)]) == 0, capsys.readouterr().err
    assert sorted((m.step, m.value) for m in client.get_metric_history(live, "train/loss")) \
        == [(1, 1.0), (2, 3.0)]
    assert (client.get_run(live).info.status, client.get_run(live).info.end_time) == (
        "FINISHED", 3_000)
    assert not (tmp_path / unsent.FILE).exists()
    warned = " ".join(r.getMessage() for r in our_records(caplog)
                      if r.name == "train.tracking.unsent")
    assert "bad!name" in warned and deleted in warned, warned


def test_a_run_deleted_while_it_trains_is_one_warning_and_nothing_is_kept(
        store_uri: str, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from mlflow.tracking import MlflowClient

    from train.tracking import unsent

    tracker = MLflowTracker(LoggerConfig(tracking_uri=store_uri, system_metrics=False))
    with caplog.at_level(logging.WARNING):
        with tracker.run("r", OmegaConf.create({"a": 1}), run_dir=tmp_path) as run_id:
            tracker.log_metrics({"train/loss": 1.0}, step=1)
            MlflowClient(tracking_uri=store_uri).delete_run(run_id)
            for step in range(2, 6):
                tracker.log_metrics({"train/loss": float(step)}, step=step)
            (tmp_path / "goodput.json").write_text("{}")
            tracker.log_files([tmp_path / "goodput.json"])
    warned = [r.getMessage() for r in our_records(caplog)]
    assert len(warned) == 1 and "deleted or not there" in warned[0], warned
    assert not (tmp_path / unsent.FILE).exists()


def test_a_hostile_unsent_file_is_read_in_bounded_memory_and_never_raises(
        tmp_path: Path) -> None:
    """What a crash or an attacker can leave: nesting too deep to parse, numbers beyond what
    MLflow stores (they would fail every send after them), a line of 64 MB without a newline,
    floods of runs and files. Each is skipped; the good lines around them are kept."""
    import tracemalloc

    from train.tracking import unsent

    run = "a" * 32
    good = json.dumps({"run": run, "metric": ["m", 1.5, 7, 3]}) + "\n"
    hostile = ['{"run": "%s", "x": %s}\n' % (run, "[" * 2040 + "]" * 2040),
               '{"run": "%s", "metric": ["m", %s, 1, 1]}\n' % (run, "9" * 400),
               json.dumps({"run": run, "metric": ["m", 1.0, 1, 2**63]}) + "\n",
               json.dumps({"run": run, "metric": ["m", 1.0, -2**64, 1]}) + "\n",
               json.dumps({"run": run, "metric": ["m", True, 1, 1]}) + "\n"]
    path = tmp_path / unsent.FILE
    with open(path, "w") as f:
        f.writelines([good, *hostile])
        f.write(run * (2 * 1024 * 1024) + "\n")  # 64 MB on one line
        f.write(good)
        f.writelines(json.dumps({"run": f"r{i}", "end": ["FAILED", i]}) + "\n"
                     for i in range(unsent.MAX_RUNS + 5))
        f.writelines(json.dumps({"run": run, "artifact": f"f{i}"}) + "\n"
                     for i in range(unsent.MAX_ARTIFACTS + 5))
    tracemalloc.start()
    try:
        kept = unsent.read(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 * 2**20, peak  # the 64 MB line was never held
    assert list(kept.metrics) == [(run, ("m", 1.5, 7, 3))] * 2
    assert len(kept.ends) == unsent.MAX_RUNS - 1  # `run` is one of the MAX_RUNS
    assert len(kept.artifacts) == unsent.MAX_ARTIFACTS


def test_what_a_run_kept_is_sent_by_the_next_launch_even_under_a_new_run(
        store_uri: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A launch whose store failed from step 2 to its end (killed before any checkpoint named
    its MLflow run): the next launch in the run directory starts a new run, sends the first
    one's kept values and ends it as it ended."""
    from mlflow.tracking import MlflowClient

    from train.tracking import unsent

    def failing(*args, **kwargs):
        raise OSError("connection refused")

    config = LoggerConfig(tracking_uri=store_uri, system_metrics=False)
    tracker = MLflowTracker(config)
    with monkeypatch.context() as patch:
        with tracker.run("r", OmegaConf.create({"a": 1}), run_dir=tmp_path) as first:
            tracker.log_metrics({"train/loss": 1.0}, step=1)
            patch.setattr(tracker.client, "log_batch", failing)
            patch.setattr(tracker.client, "log_artifact", failing)
            # MLflow's end_run drops the active run, then its client fails to reach the store
            patch.setattr(MlflowClient, "set_terminated", failing)
            for step in range(2, 5):
                tracker.log_metrics({"train/loss": float(step)}, step=step)
            (tmp_path / "goodput.json").write_text("{}")
            tracker.log_files([tmp_path / "goodput.json"])
    kept = unsent.read(tmp_path / unsent.FILE)
    assert [record[3] for _, record in kept.metrics] == [2, 3, 4]
    assert kept.artifacts == [(first, "goodput.json")] and kept.ends[first][0] == "FINISHED"
    client = MlflowClient(tracking_uri=store_uri)
    assert client.get_run(first).info.status == "RUNNING"

    tracker = MLflowTracker(config)
    with tracker.run("r", OmegaConf.create({"a": 1}), run_dir=tmp_path) as second:
        assert not (tmp_path / unsent.FILE).exists()
    assert second != first
    history = client.get_metric_history(first, "train/loss")
    assert sorted((m.step, m.value) for m in history) == [(s, float(s)) for s in range(1, 5)]
    run = client.get_run(first)
    assert (run.info.status, run.info.end_time) == ("FINISHED", kept.ends[first][1])
    assert [a.path for a in client.list_artifacts(first)] == ["config.yaml", "goodput.json"]


@pytest.mark.parametrize("text, expected", [
    ("logger:\n  tracking_uri: http://u:pw@host:5000\n", "http://host:5000"),
    ("logger:\n  tracking_uri: null\n", "sqlite:///{cwd}/mlflow.db"),  # MLflow's default
    ("logger: [1, 2]\n", None), ("{{{", None), ("- " * 10**6, None), ("", None)])
def test_the_store_a_runs_own_config_names(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                           text: str, expected) -> None:
    from train.tracking import unsent

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.chdir(tmp_path)
    (tmp_path / ".hydra").mkdir()
    (tmp_path / ".hydra" / "config.yaml").write_text(text)
    want = expected.format(cwd=tmp_path) if expected else None
    assert unsent.configured_store(tmp_path) == want


def test_a_job_with_no_store_named_does_not_log_to_the_store_an_earlier_job_named(
        store_uri: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The jobs of an in-process sweep (Hydra's basic launcher) share MLflow's global store.
    monkeypatch.chdir(tmp_path)
    assert MLflowTracker(LoggerConfig(tracking_uri=store_uri)).uri == store_uri
    assert MLflowTracker(LoggerConfig()).uri == f"sqlite:///{tmp_path}/mlflow.db"
    assert "MLFLOW_TRACKING_URI" not in os.environ  # nor to a subprocess it starts

"""MLflow as teams run it: a real `mlflow server` (started here, on loopback) that dies in the
middle of a run and is still down when the run ends. Nothing is lost: what the store did not
take waits in the run directory and is sent by the run's next launch, or by
`python -m train.unsent`, which end the run as it ended."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from support.launch import finish, launch, process_state, wait_for
from support.runs import STEPS_PER_EPOCH, EPOCHS, tiny_overrides
from support.tracking import MlflowServer
from train.tracking import unsent


@pytest.fixture
def server(tmp_path: Path):
    server = MlflowServer(tmp_path / "server")
    server.start()
    yield server
    server.kill()


def stopped(pid: int) -> bool:
    """Whether `pid` is stopped (SIGSTOP: the `stop` fault froze it)."""
    return process_state(pid) == "T"


def test_a_store_that_dies_mid_run_loses_nothing_and_the_next_launch_finishes_the_run(
        server: MlflowServer, tiny_root: Path, tmp_path: Path) -> None:
    args = ["-m", "train", "+experiment=resnet", *tiny_overrides(tiny_root), "model=tiny_cnn",
            "trainer.device=cpu", f"run.root={tmp_path}", "run.name=r",
            f"logger.tracking_uri={server.uri}", "logger.log_model=false",
            "logger.system_metrics_seconds=0.2"]
    # A dead server refuses at once: no HTTP retries, so each failed call costs nothing.
    fast = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0"}
    run = launch([sys.executable], args, fault="stop:step=4", cwd=tmp_path, **fast)
    wait_for(lambda: stopped(run.pid), "the run to stop at step 4", proc=run)
    server.kill()
    down = time.time() * 1000
    os.kill(run.pid, signal.SIGCONT)  # it trains on, and ends, with the store down
    out = finish(run, timeout=300)
    assert run.returncode == 0, out[-4000:]
    assert "still fails at the end of the run" in out and "python -m train.unsent" in out
    kept = unsent.read(tmp_path / "r" / unsent.FILE)
    (run_id,) = kept.ends
    assert kept.ends[run_id][0] == "FINISHED" and kept.metrics
    assert {name for _, name in kept.artifacts} >= {"goodput.json", "train.log"}
    link = f"{server.uri}/#/experiments/1/runs/{run_id}?workflowType=machine_learning"
    assert link in out  # it opens the run in the model-training view

    from mlflow.tracking import MlflowClient
    server.start()
    client = MlflowClient(tracking_uri=server.uri)
    assert client.get_run(run_id).info.status == "RUNNING"  # until the next launch
    again = launch([sys.executable], args, cwd=tmp_path, **fast)
    out = finish(again, timeout=300)
    assert again.returncode == 0, out[-4000:]
    assert "already complete" in out and not (tmp_path / "r" / unsent.FILE).exists()

    record = client.get_run(run_id)
    assert record.info.status == "FINISHED"
    steps = sorted(m.step for m in client.get_metric_history(run_id, "train/loss"))
    assert steps == list(range(2, STEPS_PER_EPOCH * EPOCHS + 1, 2))  # every one, none twice
    assert [m.step for m in client.get_metric_history(run_id, "val/top1")].count(
        STEPS_PER_EPOCH * EPOCHS) == 1
    system = client.get_metric_history(run_id, "system/cpu_utilization_percentage")
    assert any(m.timestamp > down for m in system), "system metrics stopped at the outage"
    artifacts = {a.path for a in client.list_artifacts(run_id)}
    assert {"goodput.json", "train.log", "config.yaml"} <= artifacts
    datasets = {d.dataset.name: d for d in record.inputs.dataset_inputs}
    assert set(datasets) == {"shapes/train", "shapes/val"}, datasets
    for name, count in (("shapes/train", 120), ("shapes/val", 30)):
        dataset = datasets[name].dataset
        assert json.loads(dataset.profile)["num_samples"] == count
        assert len(dataset.digest) == 16 and dataset.source_type == "local"
        assert json.loads(dataset.source)["uri"] == str(tiny_root / name.split("/")[1])
        assert [t.value for t in datasets[name].tags] == [
            {"shapes/train": "training", "shapes/val": "validation"}[name]]

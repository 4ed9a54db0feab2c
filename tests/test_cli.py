"""`python -m train` end to end, in subprocesses, as a user runs it."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
import torch

from support.launch import PYTHON, launch, run_train, wait_for
from support.runs import tiny_overrides


def mlflow_runs(db: Path):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{db}")
    experiment = client.get_experiment_by_name("goodput-trainer")
    return client, client.search_runs([experiment.experiment_id])


def test_a_tiny_run_trains_logs_to_mlflow_and_saves_weights(tmp_path, tiny_root):
    db = tmp_path / "mlflow.db"
    result = run_train(["+experiment=resnet", *tiny_overrides(tiny_root), "data.num_workers=2",
                        "optim.lr=0.005", f"logger.tracking_uri=sqlite:///{db}"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    client, runs = mlflow_runs(db)
    assert len(runs) == 1
    run = runs[0]
    assert run.info.status == "FINISHED"
    name = run.data.tags["mlflow.runName"]
    assert name.startswith("resnet-data.global_batch_size=20,data.image_size=32")
    assert (tmp_path / "outputs" / name / "model_final.pt").is_file()
    for key in ["train/loss", "train/lr", "train/images_per_second", "data/fetch_seconds",
                "data/fetch_seconds_p99", "data/first_batch_seconds", "val/loss", "val/top1"]:
        assert key in run.data.metrics, key
    assert [m.step for m in client.get_metric_history(run.info.run_id, "val/top1")] == [6, 12]
    assert run.data.params["optim.lr"] == "0.005"
    assert run.data.params["data.num_workers"] == "2"
    config = Path(client.download_artifacts(run.info.run_id, "config.yaml", str(tmp_path)))
    assert "global_batch_size: 20" in config.read_text()
    assert "goodput.png" in [a.path for a in client.list_artifacts(run.info.run_id)]


def test_a_multirun_sweep_gives_one_mlflow_run_per_job(tmp_path, tiny_root):
    db = tmp_path / "mlflow.db"
    result = run_train(["-m", "+experiment=resnet", *tiny_overrides(tiny_root),
                        "trainer.max_steps=2", "optim.lr=0.01,0.02",
                        f"logger.tracking_uri=sqlite:///{db}"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    _, runs = mlflow_runs(db)
    assert sorted(r.data.params["optim.lr"] for r in runs) == ["0.01", "0.02"]
    names = {r.data.tags["mlflow.runName"] for r in runs}
    assert len(names) == 2
    assert all((tmp_path / "outputs" / n / "model_final.pt").is_file() for n in names)


def train_weights(tmp_path: Path, tiny_root: Path, out: str, *extra: str) -> dict:
    result = run_train(["+experiment=resnet", *tiny_overrides(tiny_root), "logger=none",
                        "trainer.max_steps=4", f"run.root={tmp_path / out}", "run.name=r",
                        *extra], cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    return torch.load(tmp_path / out / "r" / "model_final.pt", weights_only=True)


def test_same_seed_twice_gives_bit_identical_weights(tmp_path, tiny_root):
    a = train_weights(tmp_path, tiny_root, "a", "data.num_workers=2")
    b = train_weights(tmp_path, tiny_root, "b", "data.num_workers=0")
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    # The control: another seed must change the result, or this test could not fail.
    c = train_weights(tmp_path, tiny_root, "c", "seed=1")
    assert not all(torch.equal(a[k], c[k]) for k in a)


@pytest.mark.parametrize("override, expected", [
    ("data.root={missing}", "data.root {missing} does not exist"),
    ("data.root={empty}", "data.root {empty} is empty"),
    ("model.name=resnet19", "unknown model.name 'resnet19'"),
    ("data.global_batch_size=1000", "exceeds the dataset's 120 samples"),
])
def test_user_errors_are_one_line_without_a_traceback(tmp_path, tiny_root, override, expected):
    (tmp_path / "empty").mkdir()
    paths = {"missing": tmp_path / "missing", "empty": tmp_path / "empty"}
    overrides = [*tiny_overrides(tiny_root), "logger=none", override.format(**paths)]
    result = run_train(["+experiment=resnet", *overrides], cwd=tmp_path)
    assert result.returncode == 2
    errors = result.stderr.strip().splitlines()
    assert errors == [errors[-1]] and errors[0].startswith("error: ")
    assert expected.format(**paths) in errors[0]


def test_a_resumed_run_keeps_logging_into_the_same_mlflow_run(tmp_path, tiny_root):
    db = tmp_path / "mlflow.db"
    args = ["+experiment=resnet", *tiny_overrides(tiny_root), "run.name=r",
            "checkpoint.interval_steps=3", f"logger.tracking_uri=sqlite:///{db}"]
    for max_steps in (3, 8):
        result = run_train([*args, f"trainer.max_steps={max_steps}"], cwd=tmp_path)
        assert result.returncode == 0, result.stderr[-3000:]
    client, runs = mlflow_runs(db)
    assert len(runs) == 1
    run = runs[0]
    assert run.data.tags["resumed"] == "true"
    steps = [m.step for m in client.get_metric_history(run.info.run_id, "train/loss")]
    assert steps == [2, 3, 4, 6, 8]  # the second life logged on from step 4


def test_ctrl_c_during_start_up_is_one_line_and_exit_130(tmp_path, tiny_root):
    """Before training routes SIGINT to a checkpoint, Ctrl-C lands in whatever import runs
    (here torch's, seconds long): one line, no KeyboardInterrupt traceback."""
    proc = launch(PYTHON, ["-m", "train", "+experiment=resnet", *tiny_overrides(tiny_root),
                           "logger=none", f"run.root={tmp_path}"],
                  cwd=tmp_path, stderr_apart=True)
    maps = Path(f"/proc/{proc.pid}/maps")
    wait_for(lambda: "torch" in maps.read_text(), "torch to load", proc=proc)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-3000:]
    assert err.strip().splitlines() == ["interrupted before training started: nothing to save"]
    assert "Traceback" not in out

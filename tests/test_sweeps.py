"""Sweeps for real: an Optuna search (hparams_search/optuna.yaml) and parallel jobs under the
joblib launcher, each two tiny runs in a subprocess, each one MLflow parent run with a child
run per job."""

from __future__ import annotations

import json
from pathlib import Path
from typing import List

import pytest
from omegaconf import OmegaConf

from support.launch import run_train
from support.runs import tiny_overrides
from support.tracking import mlflow_runs, sweep_runs

pytest.importorskip("hydra_plugins.hydra_joblib_launcher", reason="pip install '.[sweep]'")
optuna = pytest.importorskip("optuna", reason="pip install '.[sweep]'")


def sweep_args(tiny_root: Path, run_root: Path, *extra: str) -> List[str]:
    """A sweep of tiny one-epoch runs of the experiment's model family, on the CPU."""
    return ["-m", "+experiment=resnet", *tiny_overrides(tiny_root), "trainer.max_epochs=1",
            "model=tiny_cnn", "trainer.device=cpu", f"run.root={run_root}",
            "logger.log_model=false", *extra]


def goodput_files(run_root: Path) -> List[dict]:
    """Each job's goodput.json, in the order the jobs ended."""
    found = [json.loads(p.read_text()) for p in run_root.glob("*/goodput.json")]
    return sorted(found, key=lambda g: g["saved_at"])


def test_an_optuna_sweep_keeps_its_study_and_counts_each_job_from_its_start(tiny_root,
                                                                            tmp_path):
    result = run_train([*sweep_args(tiny_root, tmp_path, "+hparams_search=optuna",
                                    "hydra.sweeper.n_trials=2",
                                    f"logger.tracking_uri=sqlite:///{tmp_path}/mlflow.db")],
                       cwd=tmp_path, timeout=240)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    study = optuna.load_study(study_name="adamw_lr_wd",
                              storage=f"sqlite:///{tmp_path}/optuna.db")
    values = [t.value for t in study.trials]
    assert len(values) == 2 and all(v is not None and 0 <= v <= 1 for v in values), values
    for trial in study.trials:  # the search space fits AdamW, on a log scale
        assert 3e-4 <= trial.params["optim.lr"] <= 1e-2
        assert 1e-3 <= trial.params["optim.weight_decay"] <= 0.3
        assert f"optim.lr={trial.params['optim.lr']}" in trial.user_attrs["overrides"]
    best = (tmp_path / "optimization_results.yaml").read_text()
    assert f"best_value: {study.best_value}" in best
    # The best job again as a single run: its overrides without the sweep's config group
    rerun = OmegaConf.load(tmp_path / "optimization_results.yaml").best_overrides
    assert "+experiment=resnet" in rerun and "+hparams_search=optuna" not in rerun
    assert f"optim.lr={study.best_params['optim.lr']}" in rerun
    parent, jobs = sweep_runs(mlflow_runs(tmp_path / "mlflow.db")[1])  # MLflow agrees
    assert parent.data.metrics["best/val/top1"] == study.best_value
    assert parent.data.tags["sweep.sweeper"].endswith("OptunaSweeper")
    assert [float(j.data.params["optim.lr"]) for j in jobs] == [
        t.params["optim.lr"] for t in study.trials]
    first, second = goodput_files(tmp_path)
    # The jobs ran one after the other in one process: the second job's books hold no more
    # than the time since the first one ended (before the fix: the first job's time too).
    assert sum(second["seconds"].values()) <= second["saved_at"] - first["saved_at"]


def test_parallel_jobs_with_data_workers_share_a_new_mlflow_store(tiny_root, tmp_path):
    """Two jobs at once under joblib (loky workers) with DataLoader workers, both creating
    one new sqlite MLflow store."""
    store = f"sqlite:///{tmp_path}/mlflow.db"
    result = run_train([*sweep_args(tiny_root, tmp_path, "hydra/launcher=parallel",
                                    "optim.lr=1e-3,2e-3", "data.num_workers=1",
                                    f"logger.tracking_uri={store}")],
                       cwd=tmp_path, timeout=240)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "Joblib.Parallel(n_jobs=2" in result.stdout + result.stderr
    parent, jobs = sweep_runs(mlflow_runs(tmp_path / "mlflow.db")[1])
    assert [r.data.params["optim.lr"] for r in jobs] == ["0.001", "0.002"]
    assert all(r.info.status == "FINISHED" and "val/top1" in r.data.metrics for r in jobs)
    assert parent.data.tags["sweep.launcher"].endswith("JoblibLauncher")

"""Sweeps for real: an Optuna search (hparams_search/optuna.yaml) and parallel jobs under the
joblib launcher, each two tiny runs in a subprocess, each one MLflow parent run with a child
run per job."""

from __future__ import annotations

import json
from pathlib import Path
from typing import List

import pytest
import yaml
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
    # the sweep's record, its job lines written by joblib's worker processes
    (record,) = (tmp_path / "sweeps").iterdir()
    sweep = yaml.safe_load((record / "sweep.yaml").read_text())
    assert sweep["mlflow_parent_run_id"] == parent.info.run_id
    assert parent.info.run_name == f"sweep-{sweep['id']}" == f"sweep-{record.name}"
    assert parent.data.tags["sweep.record"] == str(record)
    assert [(j["job"], j["status"], j["run_name"], j["objective"]) for j in sweep["jobs"]] == [
        (i, "COMPLETED", r.info.run_name, r.data.metrics["val/top1"]) for i, r in enumerate(jobs)]
    assert [r.info.run_name.split(",")[0] for r in jobs] == [
        "resnet-optim.lr=0.001", "resnet-optim.lr=0.002"]  # the swept value leads


def test_every_sweep_keeps_its_own_record_and_a_complete_job_reports_what_it_reached(
        tiny_root, tmp_path):
    """Two sweeps into one run.root, the second sharing a job with the first: the first's
    record is untouched, job names lead with the swept value, and the job the second sweep
    finds complete returns the objective it reached (it was None, failing an Optuna trial)."""
    args = sweep_args(tiny_root, tmp_path, "logger=none", "trainer.max_steps=2")
    first = run_train([*args, "optim.lr=1e-3,2e-3"], cwd=tmp_path, timeout=240)
    assert first.returncode == 0, first.stderr[-3000:]
    (record,) = (tmp_path / "sweeps").iterdir()
    kept = {p.name: p.read_bytes() for p in record.iterdir()}
    assert set(kept) == {"multirun.yaml", "sweep.yaml", "jobs.jsonl"}
    second = run_train([*args, "optim.lr=2e-3,4e-3"], cwd=tmp_path, timeout=240)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "already complete" in second.stdout + second.stderr
    records = sorted((tmp_path / "sweeps").iterdir())
    assert len(records) == 2 and record in records
    assert {p.name: p.read_bytes() for p in record.iterdir()} == kept  # no later sweep touches
    sweeps = [yaml.safe_load((r / "sweep.yaml").read_text()) for r in records]
    hydra_records = [yaml.safe_load((r / "multirun.yaml").read_text()) for r in records]
    for sweep, hydra, lrs, swept in zip(sweeps, hydra_records, [("0.001", "0.002"),
                                                                 ("0.002", "0.004")],
                                        ["optim.lr=1e-3,2e-3", "optim.lr=2e-3,4e-3"]):
        assert sweep["id"] in str(records) and sweep["started"] <= sweep["ended"]
        assert swept in hydra["hydra"]["overrides"]["task"] and sweep["swept"] == ["optim.lr"]
        assert [job["job"] for job in sweep["jobs"]] == [0, 1]
        for job, lr in zip(sweep["jobs"], lrs):
            assert job["status"] == "COMPLETED" and 0 <= job["objective"] <= 1, job
            assert job["run_name"].startswith(f"resnet-optim.lr={lr},"), job["run_name"]
            assert len(job["run_name"]) <= 120 and Path(job["dir"]).name == job["run_name"]
            assert (Path(job["dir"]) / "goodput.json").is_file()
    # the same job in both sweeps: one run, whose second launch trained nothing
    assert sweeps[0]["jobs"][1]["run_name"] == sweeps[1]["jobs"][0]["run_name"]
    assert sweeps[1]["jobs"][0]["objective"] == sweeps[0]["jobs"][1]["objective"]


def test_a_sweep_record_lists_each_job_once_and_one_that_never_returned_as_running(tmp_path):
    """Job lines from parallel processes, a job that exited the process (SystemExit skips
    Hydra's job-end callback), a line torn by a kill, and lines that parse but are no job's
    (one of them made Hydra drop the whole record with a warning)."""
    from train.tracking.sweep_record import read_jobs, swept_keys

    start = {"event": "start", "run_name": "r", "dir": "d", "overrides": [],
             "mlflow_parent_run_id": None, "time": "t0"}
    lines = [{**start, "job": 1}, {**start, "job": 0},
             {**start, "job": 0, "event": "end", "status": "COMPLETED", "objective": 0.5,
              "time": "t1"}]
    path = tmp_path / "jobs.jsonl"
    odd = ["{}", "[1]", '"x"', '{"job": null, "time": "t"}', '{"job": 1e400, "time": "t"}',
           '{"job": 3, "event": "end"}', '{"job": true, "time": "t"}', "[" * 5000]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines) + "\n".join(odd)
                    + '\n{"job": 2, "ev')
    jobs = read_jobs(path)
    assert [(j["job"], j["status"], j["objective"], j["started"], j.get("ended"))
            for j in jobs] == [(0, "COMPLETED", 0.5, "t0", "t1"), (1, "RUNNING", None, "t0",
                                                                   None)]
    assert swept_keys(["a=1", "b=1,2", "+c=range(1,3)", "d=choice(x,y)", "model=x,y"],
                      {"e": "interval(0, 1)"}) == ["b", "c", "d", "e", "model"]

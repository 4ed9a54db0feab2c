"""The Optuna sweeper as a user meets it through `python -m train -m +hparams_search=optuna`:
found from any directory after the README's install (and a regular one), bad storage or
search space as one line with exit code 2, failed jobs under joblib ending the sweep with
their own exit code and no trial left RUNNING."""

from __future__ import annotations

import os
import shutil
import sqlite3
import subprocess
import sys
import sysconfig
from pathlib import Path
from typing import Dict, List

import pytest

from support.launch import finish, launch, run_train
from support.runs import REPO, tiny_overrides

optuna = pytest.importorskip("optuna", reason="pip install '.[sweep]'")
pytest.importorskip("hydra_plugins.hydra_joblib_launcher", reason="pip install '.[sweep]'")

# What a wheel of the project is built from (pyproject.toml's packages, and its readme).
SOURCES = ["pyproject.toml", "README.md", "train", "data", "checkpointing", "common",
           "hydra_plugins", "conf"]


def optuna_sweep(run_root: Path, *extra: str) -> List[str]:
    return ["-m", "+experiment=resnet", "+hparams_search=optuna", f"run.root={run_root}",
            "logger=none", "trainer.device=cpu", *extra]


def one_line_refusal(result: subprocess.CompletedProcess) -> str:
    """The one line a refused sweep prints, after checking it ended so: exit 2, no
    traceback."""
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2, result.stdout[-3000:] + result.stderr[-3000:]
    assert len(lines) == 1 and "Traceback" not in result.stdout + result.stderr, lines
    return lines[0]


def mlflow_store(path: Path) -> None:
    from mlflow.tracking import MlflowClient

    MlflowClient(tracking_uri=f"sqlite:///{path}").search_experiments()


@pytest.mark.parametrize("case", ["corrupt", "locked", "mlflow", "driver", "reversed"])
def test_a_bad_storage_or_search_space_is_one_line_and_exit_2(tmp_path, case) -> None:
    db = tmp_path / "optuna.db"
    extra = {"driver": ["hydra.sweeper.storage=mysql://sweeper:s3cret@127.0.0.1:1/optuna"],
             "reversed": ["optim.lr=interval(1e-2, 1e-4)"]}.get(case, [])
    says = {"corrupt": "not an sqlite database, or a corrupt one",
            "locked": "the database is locked by another process",
            "mlflow": "this file is MLflow's tracking store, not an Optuna study",
            "driver": "the driver for this database is not installed",
            "reversed": "its low end 0.01 is above its high end 0.0001"}[case]
    lock = None
    if case == "corrupt":
        db.write_bytes(b"\x00 not a database " * 512)
    elif case == "mlflow":
        mlflow_store(db)
    elif case == "locked":
        optuna.create_study(study_name="adamw_lr_wd", storage=f"sqlite:///{db}")
        lock = sqlite3.connect(db, isolation_level=None)
        lock.execute("BEGIN EXCLUSIVE")
    try:
        line = one_line_refusal(run_train(optuna_sweep(tmp_path, *extra), cwd=tmp_path,
                                          timeout=120))
    finally:
        if lock is not None:
            lock.close()
    assert says in line and "s3cret" not in line, line
    if case == "corrupt":  # left as it was
        assert db.read_bytes() == b"\x00 not a database " * 512
    if case == "mlflow":  # no Optuna table added to MLflow's store
        tables = {row[0] for row in sqlite3.connect(db).execute(
            "SELECT name FROM sqlite_master WHERE type = 'table'")}
        assert "experiments" in tables and "studies" not in tables


def test_failed_jobs_under_joblib_end_the_sweep_with_their_exit_code(tiny_root, tmp_path):
    """Every job fails as a crashed run does (exit 1, retryable): the sweep ends with exit 1,
    not the 2 of a config error, and every trial is marked failed."""
    proc = launch([sys.executable], ["-m", "train", *optuna_sweep(
        tmp_path, *tiny_overrides(tiny_root), "model=tiny_cnn", "trainer.max_steps=2",
        "hydra/launcher=parallel", "hydra.sweeper.n_jobs=2", "hydra.sweeper.n_trials=2")],
        fault="raise:step=1", cwd=tmp_path)
    out = finish(proc, timeout=240)
    assert proc.returncode == 1, out[-4000:]
    study = optuna.load_study(study_name="adamw_lr_wd", storage=f"sqlite:///{tmp_path}/optuna.db")
    assert [t.state.name for t in study.trials] == ["FAIL", "FAIL"]


def fresh_install(tmp_path: Path, editable: bool) -> Path:
    """This checkout installed as a user installs it, into a new virtual environment that
    sees this interpreter's packages (torch, Hydra, ...) as plain paths: their `.pth` files,
    among them this project's own install, do not run there. Its Python."""
    source = tmp_path / "src"
    source.mkdir()
    for name in SOURCES:
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, source / name,
                            ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(REPO / name, source / name)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()"
                           "['purelib'])"], check=True, capture_output=True, text=True)
    Path(site.stdout.strip(), "system-site-packages.pth").write_text(
        sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q",
                    "--no-deps", "--no-build-isolation", "--no-index",
                    *(["-e"] if editable else []), str(source)],
                   check=True, capture_output=True, cwd=tmp_path)
    return python


def user_env() -> Dict[str, str]:
    return {k: v for k, v in os.environ.items()
            if k not in ("PYTHONPATH", "GOODPUT_FAULT") and not k.startswith("MLFLOW_")}


def test_the_readme_sweep_finds_the_sweeper_from_any_directory(tiny_root, tmp_path) -> None:
    """`pip install -e .` then the README's Optuna sweep, from a directory of the user's (no
    PYTHONPATH): Hydra's plugin scan finds the sweeper and the sweep runs its trial."""
    python = fresh_install(tmp_path, editable=True)
    work = tmp_path / "project"
    work.mkdir()
    result = subprocess.run(
        [str(python), "-m", "train", *optuna_sweep(
            work / "runs", *tiny_overrides(tiny_root), "model=tiny_cnn", "trainer.max_steps=1",
            "hydra.sweeper.n_trials=1")],
        cwd=work, env=user_env(), capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    study = optuna.load_study(study_name="adamw_lr_wd",
                              storage=f"sqlite:///{work}/runs/optuna.db")
    assert [t.state.name for t in study.trials] == ["COMPLETE"]


def test_a_regular_install_finds_the_sweeper_and_its_configs(tmp_path) -> None:
    python = fresh_install(tmp_path, editable=False)
    result = subprocess.run(
        [str(python), "-m", "train", "+experiment=resnet", "+hparams_search=optuna",
         "--cfg", "hydra", "--package", "hydra.sweeper"],
        cwd=tmp_path, env=user_env(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "_target_: hydra_plugins.goodput_optuna_sweeper.optuna_sweeper.OptunaSweeper" in \
        result.stdout
    assert "study_name: adamw_lr_wd" in result.stdout

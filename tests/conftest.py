"""Session fixtures: the tiny shapes dataset and the uninterrupted reference runs, each made
once for the whole session, however many xdist workers share it (`support.shared`). The
helpers the tests share are in tests/support/."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from data import synthetic
from support.checkpoints import reference_of
from support.launch import run_job, torchrun
from support.runs import TINY, train_args
from support.shared import made_once

# Most tests wait on subprocesses (restarts, timeouts, torchrun start-up), so three workers
# keep two cores busy. Here rather than in addopts, so that `-p no:xdist` still parses.
WORKERS, DIST = 3, "worksteal"


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config: pytest.Config) -> None:
    """`python -m pytest` runs on WORKERS xdist workers unless `-n` says otherwise (`-n 0`
    or `-p no:xdist`: serially); xdist's own hook, which runs after this one, starts them."""
    if (config.pluginmanager.has_plugin("xdist") and config.option.numprocesses is None
            and not os.environ.get("PYTEST_XDIST_WORKER") and not config.option.usepdb):
        config.option.numprocesses = WORKERS
        if config.option.dist == "no":
            config.option.dist = DIST


@pytest.fixture(autouse=True)
def mlflow_store_left_as_found():
    """An in-process run sets MLflow's global store (and MLFLOW_TRACKING_URI with it); put
    both back, so that no later test on this worker logs to, or reads, that store."""
    before = os.environ.get("MLFLOW_TRACKING_URI")
    yield
    if "mlflow" in sys.modules:
        sys.modules["mlflow"].set_tracking_uri(before)
    if before is not None:
        os.environ["MLFLOW_TRACKING_URI"] = before


@pytest.fixture(scope="session")
def tiny_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    def make(data: Path) -> None:
        synthetic.generate(data / "shapes", TINY["num_train"], TINY["num_val"], TINY["size"],
                           seed=0, workers=2)
    return made_once(tmp_path_factory, "data", make) / "shapes"


@pytest.fixture(scope="session")
def reference_runs(tiny_root: Path, tmp_path_factory: pytest.TempPathFactory):
    """`reference_runs(strategy)`: the uninterrupted 2-rank run (`support.runs.train_args`)
    that faulty runs are compared with, made once per strategy on first use."""
    made: dict = {}

    def reference(strategy: str = "ddp") -> dict:
        if strategy not in made:
            root = made_once(tmp_path_factory, f"reference_{strategy}", lambda root: run_job(
                torchrun(2), train_args(tiny_root, root, strategy=strategy)))
            made[strategy] = reference_of(root)
        return made[strategy]
    return reference


@pytest.fixture(scope="session")
def ddp_reference(reference_runs) -> dict:
    return reference_runs("ddp")

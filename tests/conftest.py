"""Session fixtures: the tiny shapes dataset and the uninterrupted reference runs. The
helpers the tests share are in tests/support/."""

from __future__ import annotations

from pathlib import Path

import pytest

from data import synthetic
from support.checkpoints import reference_of
from support.launch import run_job, torchrun
from support.runs import TINY, train_args


@pytest.fixture(scope="session")
def tiny_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("data") / "shapes"
    synthetic.generate(root, TINY["num_train"], TINY["num_val"], TINY["size"], seed=0, workers=2)
    return root


@pytest.fixture(scope="session")
def reference_runs(tiny_root: Path, tmp_path_factory: pytest.TempPathFactory):
    """`reference_runs(strategy)`: the uninterrupted 2-rank run (`support.runs.train_args`)
    that faulty runs are compared with, made once per strategy on first use."""
    made: dict = {}

    def reference(strategy: str = "ddp") -> dict:
        if strategy not in made:
            root = tmp_path_factory.mktemp(f"reference_{strategy}")
            run_job(torchrun(2), train_args(tiny_root, root, strategy=strategy))
            made[strategy] = reference_of(root)
        return made[strategy]
    return reference


@pytest.fixture(scope="session")
def ddp_reference(reference_runs) -> dict:
    return reference_runs("ddp")

"""Shared fixtures: a tiny shapes dataset, Hydra's compose API, and a `python -m train` runner."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import List

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from data import synthetic
from train.config import register_configs

REPO = Path(__file__).resolve().parents[1]
CONF = REPO / "conf"

# Small enough that a whole run takes seconds: 120 + 30 images of 32x24.
TINY = {"num_train": 120, "num_val": 30, "size": 32}


@pytest.fixture(scope="session")
def tiny_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("data") / "shapes"
    synthetic.generate(root, TINY["num_train"], TINY["num_val"], TINY["size"], seed=0, workers=2)
    return root


def tiny_overrides(root: Path) -> List[str]:
    """A few-second run on the tiny dataset."""
    return [f"data.root={root}", "data.image_size=32", "data.global_batch_size=20",
            "data.val_batch_size=30", "trainer.max_epochs=2", "scheduler.warmup_steps=2",
            "trainer.log_every_steps=2", "data.num_workers=0"]


def compose_config(overrides: List[str]) -> DictConfig:
    register_configs()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name="config", overrides=overrides)


def run_train(args: List[str], cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    """`python -m train ARGS` in `cwd`, as a user would type it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-m", "train", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)

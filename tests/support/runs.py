"""The tiny runs the tests train: their overrides, their config, their length."""

from __future__ import annotations

from pathlib import Path
from typing import List

from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from train.config import register_configs

REPO = Path(__file__).resolve().parents[2]
CONF = REPO / "conf"

# Small enough that a whole run takes seconds: 120 + 30 images of 32x24.
TINY = {"num_train": 120, "num_val": 30, "size": 32}
STEPS_PER_EPOCH, EPOCHS, NUM_TRAIN = 6, 2, 120  # tiny_overrides: 120 images, batches of 20
FINAL = f"step_{STEPS_PER_EPOCH * EPOCHS:09d}"  # the checkpoint a tiny run ends with


def tiny_overrides(root: Path | str) -> List[str]:
    """A few-second run on the tiny dataset."""
    return [f"data.root={root}", "data.image_size=32", "data.global_batch_size=20",
            "data.val_batch_size=30", "trainer.max_epochs=2", "scheduler.warmup_steps=2",
            "trainer.log_every_steps=2", "data.num_workers=0"]


def train_args(tiny_root: Path, run_root: Path, *extra: str,
               strategy: str = "ddp") -> List[str]:
    """`-m train ...` for a small run whose every step is in the ledger. Dropout draws from
    the RNG, so a resume that got the RNG wrong shows in the weights."""
    return ["-m", "train", *tiny_overrides(tiny_root), "model=tiny_cnn", "model.dropout=0.3",
            f"strategy={strategy}", "strategy.timeout_seconds=20",
            "strategy.init_timeout_seconds=90", "logger=none", "trainer.device=cpu",
            "checkpoint.interval_steps=2",
            f"audit.ledger={run_root / 'ledger.jsonl'}", f"run.root={run_root}", "run.name=r",
            *extra]


def compose_config(overrides: List[str], return_hydra_config: bool = False) -> DictConfig:
    register_configs()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name="config", overrides=overrides,
                       return_hydra_config=return_hydra_config)

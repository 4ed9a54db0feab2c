"""World-size changes under torchrun: 2 ranks -> 1 -> 2, and 2 -> 3. The same samples in
every global step as a fixed-size run, every sample once per epoch, and what each resume
loaded equal to what was saved. The model has no BatchNorm (on CPU its statistics come from
the per-rank batch, so with BatchNorm the trajectory legitimately depends on the world
size), so the losses must match the fixed-size run's closely too."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Dict

import pytest
import torch

from checkpointing.storage import Store
from data.sampler import epoch_permutation
from support.checkpoints import checkpoint_contents, complete_now
from support.launch import PYTHON, run_job, torchrun
from support.ledger import assert_exactly_once, assert_resumed, samples_per_step, surviving_history
from support.runs import FINAL, train_args


def args(tiny_root: Path, root: Path, world: int, *extra: str) -> list:
    return train_args(tiny_root, root, "model=tiny_cnn_nobn", "model.dropout=0", *extra,
                      strategy="ddp" if world > 1 else "single")


def launcher(world: int) -> list:
    return torchrun(world) if world > 1 else PYTHON


def resume_at(tiny_root: Path, root: Path, world: int, *extra: str) -> int:
    """Run on at `world` ranks; the checkpoint it resumed from."""
    since = time.time()
    committed = complete_now(Store(str(root / "r" / "checkpoints")))
    run_job(launcher(world), args(tiny_root, root, world, *extra))
    return assert_resumed(root / "ledger.jsonl", since, committed)


def global_losses(ledger: Path) -> Dict[int, float]:
    """Each step's loss over the whole global batch (ranks hold equal shares of it)."""
    return {step: sum(float.fromhex(r["loss"]) for r in records) / len(records)
            for step, records in surviving_history(ledger).items()}


def assert_loaded_what_was_saved(tiny_root: Path, root: Path, world: int, step: int,
                                 *extra: str) -> None:
    """Resume at `world` ranks with nothing left to train: the weights the run then writes
    are exactly what it loaded, and must be exactly what step `step` saved."""
    run_job(launcher(world), args(tiny_root, root, world, *extra,
                                  f"trainer.max_steps={step}"))
    saved = checkpoint_contents(root / "r" / "checkpoints" / f"step_{step:09d}")
    loaded = torch.load(root / "r" / "model_final.pt", weights_only=True)
    assert loaded.keys() == {k[len("model."):] for k in saved if k.startswith("model.")}
    for key, tensor in loaded.items():
        assert torch.equal(tensor, saved[f"model.{key}"]), key


@pytest.fixture(scope="module")
def fixed_size(tiny_root, tmp_path_factory):
    root = tmp_path_factory.mktemp("fixed")
    run_job(torchrun(2), args(tiny_root, root, 2))
    return root / "ledger.jsonl"


def test_world_size_2_then_1_then_2(tiny_root, tmp_path, fixed_size):
    ledger = tmp_path / "ledger.jsonl"
    run_job(torchrun(2), args(tiny_root, tmp_path, 2, "trainer.max_steps=4"))
    assert_loaded_what_was_saved(tiny_root, tmp_path, 1, 4)
    assert resume_at(tiny_root, tmp_path, 1, "trainer.max_steps=8") == 4
    assert_loaded_what_was_saved(tiny_root, tmp_path, 2, 8)
    assert resume_at(tiny_root, tmp_path, 2) == 8

    worlds = {step: records[0]["world"] for step, records in surviving_history(ledger).items()}
    assert worlds == {s: 2 if s <= 4 or s > 8 else 1 for s in range(1, 13)}
    assert samples_per_step(ledger) == samples_per_step(fixed_size)
    assert_exactly_once(ledger)
    ours, reference = global_losses(ledger), global_losses(fixed_size)
    assert ours.keys() == reference.keys()
    for step in ours:  # summation order differs with the world size: close, not equal
        assert ours[step] == pytest.approx(reference[step], rel=1e-4), step
    assert (tmp_path / "r" / "checkpoints" / FINAL).exists()


def test_world_size_2_then_3(tiny_root, tmp_path):
    """Three ranks split each global batch of 30 in 10s: every step's samples are the global
    batch the data order defines (whatever the world size), each sample once per epoch."""
    ledger, batch = tmp_path / "ledger.jsonl", "data.global_batch_size=30"
    run_job(torchrun(2), args(tiny_root, tmp_path, 2, batch, "trainer.max_steps=3"))
    assert_loaded_what_was_saved(tiny_root, tmp_path, 3, 3, batch)
    assert resume_at(tiny_root, tmp_path, 3, batch) == 3
    worlds = {step: records[0]["world"] for step, records in surviving_history(ledger).items()}
    assert worlds == {s: 2 if s <= 3 else 3 for s in range(1, 9)}
    expected = {}
    for step in range(1, 9):  # 4 steps of 30 per epoch of 120
        epoch, within = divmod(step - 1, 4)
        expected[step] = sorted(epoch_permutation(0, epoch, 120)[within * 30:][:30].tolist())
    assert samples_per_step(ledger) == expected
    assert_exactly_once(ledger, steps_per_epoch=4)

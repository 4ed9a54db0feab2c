"""A tiny job saved and loaded in one process by CheckpointManager, and the hostile payloads
planted in its checkpoints."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from checkpointing import commit
from checkpointing.manager import CheckpointManager, CheckpointOptions
from checkpointing.storage import Store
from train.resume.stateful import (DataIdentity, ModelState, OptimizerState, Position,
                                   position_state, read_position)

IDENTITY = DataIdentity(0, 30, 10)


def make_model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16),
                               torch.nn.Linear(16, 4))


class Job:
    """A tiny model, optimizer and data position, with one training step done."""

    def __init__(self, seed: int = 0) -> None:
        torch.manual_seed(seed)
        self.model = make_model()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=0.01)
        self.position = Position()
        self.step()

    def step(self) -> None:
        self.model(torch.randn(6, 8)).sum().backward()  # also moves BatchNorm statistics
        self.optimizer.step()
        self.optimizer.zero_grad()
        self.position = self.position.advanced(steps_per_epoch=3)

    def state(self) -> dict:
        return {"model": ModelState(self.model),
                "optim": OptimizerState(self.model, self.optimizer),
                "position": PositionState(self)}

    def snapshot(self) -> dict:
        return {"model": {k: v.clone() for k, v in self.model.state_dict().items()},
                "optim": {i: {k: v.clone() for k, v in s.items()}
                          for i, s in self.optimizer.state_dict()["state"].items()},
                "position": self.position}


class PositionState:
    """The job's position as the trainer saves it (`position_state`), loaded back into it."""

    def __init__(self, job: Job) -> None:
        self.job = job

    def state_dict(self) -> dict:
        return position_state(self.job.position, IDENTITY)

    def load_state_dict(self, state: dict) -> None:
        self.job.position = read_position(state, IDENTITY)


def same(a: dict, b: dict) -> bool:
    if a.keys() != b.keys():
        return False
    for k in a:
        x, y = a[k], b[k]
        if isinstance(x, dict):
            if not same(x, y):
                return False
        elif isinstance(x, torch.Tensor):
            if not torch.equal(x, y):
                return False
        elif x != y:
            return False
    return True


def manager(root: Path, **kw) -> CheckpointManager:
    return CheckpointManager(CheckpointOptions(dir=str(root), **kw))


def load_into_fresh(mgr: CheckpointManager) -> tuple:
    job = Job(seed=123)  # different weights: everything must come from the checkpoint
    loaded = mgr.load_latest(job.state())
    return (loaded and loaded.step), job.snapshot()


def two_checkpoints(tmp_path: Path, **kw) -> tuple:
    job = Job()
    mgr = manager(tmp_path / "ckpt", async_mode="off", **kw)
    mgr.save(1, job.state())
    first = job.snapshot()
    job.step()
    mgr.save(2, job.state())
    return tmp_path / "ckpt", first


class Payload:
    """Unpickling this runs a shell command: what a planted checkpoint file would do."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def rewrite_marker(step_dir: Path) -> None:
    """Re-sign the files as the attacker would, so only the safe loader stands in the way."""
    store = Store(str(step_dir.parent))
    files = {p.name: commit.FileRecord(p.stat().st_size, store.checksum(str(p), "sha256"))
             for p in step_dir.iterdir() if p.name != "commit_rank_0.json"}
    commit.write_marker(store, step_dir.name, int(step_dir.name[5:]), 0, 1, files)


def with_planted_step(job: Job, marker: Path) -> dict:
    """`job.state()` with the step (a non-tensor item) replaced by a `Payload`."""
    planted = position_state(job.position, IDENTITY)
    planted["trainer"]["step"] = Payload(marker)
    return {**job.state(), "position": planted}

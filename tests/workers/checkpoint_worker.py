"""Run under torchrun by tests/test_checkpoint_multirank.py: save or load a checkpoint with
CheckpointManager at the launched world size, and report what each rank saw as JSON."""

from __future__ import annotations

import errno
import json
import logging
import os
import sys
from pathlib import Path

import torch

from checkpointing.manager import CheckpointError, CheckpointManager, CheckpointOptions
from checkpointing.storage import Store
from train.cluster.world import World, init_world, shutdown_world
from train.resume.stateful import ModelState, OptimizerState, RNGState


def build(seed: int) -> tuple:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.BatchNorm1d(8))
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(5, 6)).sum().backward()
    optimizer.step()
    return model, optimizer


def recording_reads() -> list:
    """The paths of the files whose bytes this process reads for a checksum, from now on."""
    read: list = []
    checksum = Store.checksum

    def recorded(store: Store, path: str, algorithm: str) -> str:
        read.append(path)
        return checksum(store, path, algorithm)

    Store.checksum = recorded  # type: ignore[method-assign]
    return read


def swapping_first_read(kind: str) -> None:
    """The first file this process reads for a checksum is, just before, replaced with a
    FIFO (`kind` "fifo") or a link to /dev/zero ("zero"): as if swapped after rank 0's
    listing of the checkpoint found a regular file there."""
    checksum = Store.checksum
    swapped: list = []

    def swapping(store: Store, path: str, algorithm: str) -> str:
        if not swapped:
            swapped.append(path)
            os.remove(path)
            os.mkfifo(path) if kind == "fifo" else os.symlink("/dev/zero", path)
        return checksum(store, path, algorithm)

    Store.checksum = swapping  # type: ignore[method-assign]


def unlistable() -> None:
    """This process's listings of a checkpoint directory fail, as a store's that is gone."""
    def failing(store: Store, path: str | None = None) -> list:
        raise OSError(errno.EIO, "Input/output error", path or store.root)

    Store.listdir = failing  # type: ignore[method-assign]


def discover(manager: CheckpointManager, swap: str = "") -> dict:
    """The complete checkpoints the ranks agree on (or the error every rank raised), the
    files whose bytes this rank read for their checksums, and the warnings it logged. With
    `swap`, rank 1's first read is of a file swapped meanwhile (`swapping_first_read`), or
    ("unlistable") rank 0 cannot list the checkpoints."""
    warnings = []
    if swap == "unlistable" and manager.rank == 0:
        unlistable()
    elif swap and swap != "unlistable" and manager.rank == 1:
        swapping_first_read(swap)

    class Warnings(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            warnings.append(record.getMessage())

    read = recording_reads()
    logging.getLogger("checkpointing.manager").addHandler(Warnings(logging.WARNING))
    try:
        complete = [list(c) for c in manager.complete_checkpoints()]
    except CheckpointError as err:
        return {"error": str(err)}
    return {"complete": complete, "read": read, "warnings": warnings}


def staged(world: World, directory: str, out: str, mode: str) -> dict:
    """Two saves through a staging tier (one per node: here both ranks share it), or a
    resume with it; the files whose bytes this rank read for their checksums meanwhile."""
    manager = CheckpointManager(CheckpointOptions(dir=directory, staging_dir=str(Path(out,
                                                                                     "stage")),
                                                  async_mode="thread"),
                                world.rank, world.world_size, world.control_group)
    model, optimizer = build(seed=0)
    state = {"model": ModelState(model, world.control_group),
             "optim": OptimizerState(model, optimizer)}
    read = recording_reads()
    if mode == "save-staged":
        for step in (7, 8):
            manager.save(step, state)
        manager.close()
        return {"read": read}
    return {"step": manager.load_latest(state).step, "read": read}


def main(mode: str, directory: str, out: str) -> None:
    world = init_world(torch.device("cpu"), timeout_s=60)
    manager = CheckpointManager(CheckpointOptions(dir=directory, async_mode="thread"),
                                world.rank, world.world_size, world.control_group)
    if mode in ("discover", "discover-fifo", "discover-zero", "discover-unlistable",
                "save-staged", "load-staged"):
        report = (discover(manager, mode.partition("-")[2]) if mode.startswith("discover")
                  else staged(world, directory, out, mode))
        Path(out, f"rank{world.rank}.json").write_text(json.dumps(report))
        shutdown_world()
        return
    model, optimizer = build(seed=0 if mode == "save" else 99)
    state = {"model": ModelState(model, world.control_group),
             "optim": OptimizerState(model, optimizer), "rng": RNGState(world.rank)}
    if mode == "save":
        # Every rank's BatchNorm sees its own batch, as under DDP between forwards.
        model(torch.randn(5, 6) + world.rank)
        rank0_running_mean = model[1].running_mean.tolist() if world.rank == 0 else None
        torch.manual_seed(1000 + world.rank)  # a different stream on every rank
        manager.save(7, state)
        manager.close()
        step = 7
        Path(out, f"rank{world.rank}-before.json").write_text(json.dumps(rank0_running_mean))
    else:
        step = manager.load_latest(
            state, optional_keys=lambda saved: ["rng"] if saved != world.world_size else []).step
    report = {"rank": world.rank, "step": step,
              "weight_sum": float(model[0].weight.double().sum()),
              "running_mean": model[1].running_mean.tolist(),
              "exp_avg_sum": float(sum(s["exp_avg"].double().sum()
                                       for s in optimizer.state.values())),
              "next_random": torch.rand(3).tolist()}
    Path(out, f"rank{world.rank}.json").write_text(json.dumps(report))
    shutdown_world()


if __name__ == "__main__":
    main(*sys.argv[1:4])

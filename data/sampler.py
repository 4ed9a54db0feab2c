"""The sample order: a pure function of (seed, epoch, dataset size, global batch size).

Each epoch is one global permutation. Step s of an epoch consumes the global batch
`perm[s*B:(s+1)*B]`; rank r of W takes the r-th contiguous slice of it, cut further into
`grad_accum_steps` micro-batches. So the samples of a global step never depend on the world
size, the worker count or restarts, and a run can resume from (epoch, step) alone. The
incomplete last global batch of an epoch is dropped (`dropped_per_epoch` says how many).

Items are `(epoch, index)` pairs: the dataset derives each sample's augmentation from them,
which keeps persistent DataLoader workers correct without any `set_epoch` call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, List, Tuple

import numpy as np
import torch

from data.errors import DatasetError

Key = Tuple[int, int]  # (epoch, dataset index)


def derive_seed(*parts: int) -> int:
    """A well-mixed 63-bit seed from integers (neighbouring inputs give unrelated seeds)."""
    return int(np.random.SeedSequence(list(parts)).generate_state(1, np.uint64)[0] >> 1)


@dataclass(frozen=True)
class BatchPlan:
    dataset_size: int
    global_batch_size: int
    world_size: int = 1
    grad_accum_steps: int = 1

    def __post_init__(self) -> None:
        per_step = self.world_size * self.grad_accum_steps
        if self.global_batch_size % per_step:
            raise DatasetError(
                f"data.global_batch_size={self.global_batch_size} must divide by world size "
                f"x trainer.grad_accum_steps = {per_step}: pick a multiple of {per_step}")
        if self.steps_per_epoch < 1:
            raise DatasetError(
                f"data.global_batch_size={self.global_batch_size} exceeds the dataset's "
                f"{self.dataset_size} samples: lower it")

    @property
    def steps_per_epoch(self) -> int:
        return self.dataset_size // self.global_batch_size

    @property
    def dropped_per_epoch(self) -> int:
        return self.dataset_size - self.steps_per_epoch * self.global_batch_size

    @property
    def micro_batch_size(self) -> int:
        return self.global_batch_size // (self.world_size * self.grad_accum_steps)


def epoch_permutation(seed: int, epoch: int, dataset_size: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(derive_seed(seed, epoch, dataset_size))
    return torch.randperm(dataset_size, generator=generator)


class GlobalBatchSampler(torch.utils.data.Sampler[List[Key]]):
    """Yields this rank's micro-batches forever, from (start_epoch, start_step) on."""

    def __init__(self, plan: BatchPlan, seed: int, rank: int = 0, start_epoch: int = 0,
                 start_step: int = 0) -> None:
        if not 0 <= rank < plan.world_size:
            raise ValueError(f"rank {rank} outside world size {plan.world_size}")
        self.plan, self.seed, self.rank = plan, seed, rank
        self.start_epoch, self.start_step = start_epoch, start_step

    def __iter__(self) -> Iterator[List[Key]]:
        plan = self.plan
        per_rank = plan.global_batch_size // plan.world_size
        epoch, step = self.start_epoch, self.start_step
        while True:
            # A tensor, sliced step by step: the epoch as a Python list would be 36 bytes
            # a sample per rank (46 MB for ImageNet), built again at every resume.
            perm = epoch_permutation(self.seed, epoch, plan.dataset_size)
            for s in range(step, plan.steps_per_epoch):
                first = s * plan.global_batch_size + self.rank * per_rank
                local = perm[first:first + per_rank].tolist()
                for m in range(plan.grad_accum_steps):
                    micro = local[m * plan.micro_batch_size:(m + 1) * plan.micro_batch_size]
                    yield [(epoch, i) for i in micro]
            epoch, step = epoch + 1, 0


def split_bounds(global_batch_size: int, part: int, parts: int) -> Tuple[int, int]:
    """Where `part` of `parts` cuts the global batch: contiguous, sizes differing by at most
    one, so any number of parts covers it exactly once."""
    return (part * global_batch_size // parts, (part + 1) * global_batch_size // parts)


class SplitBatchSampler(torch.utils.data.Sampler[List[Key]]):
    """Yields `part`'s share of every global batch, one batch per step, from (start_epoch,
    start_step) on, for a width that may change between steps (strategy=ddp_ft, whose
    participants are only known step by step): the global batches are `GlobalBatchSampler`'s,
    the split is `split_bounds`."""

    def __init__(self, plan: BatchPlan, seed: int, part: int, parts: int, start_epoch: int = 0,
                 start_step: int = 0) -> None:
        if not 0 <= part < parts:
            raise ValueError(f"part {part} outside {parts} parts")
        self.plan, self.seed, self.part, self.parts = plan, seed, part, parts
        self.start_epoch, self.start_step = start_epoch, start_step

    def __iter__(self) -> Iterator[List[Key]]:
        plan, (lo, hi) = self.plan, split_bounds(self.plan.global_batch_size, self.part,
                                                 self.parts)
        epoch, step = self.start_epoch, self.start_step
        while True:
            perm = epoch_permutation(self.seed, epoch, plan.dataset_size)  # as above
            for s in range(step, plan.steps_per_epoch):
                first = s * plan.global_batch_size
                yield [(epoch, i) for i in perm[first + lo:first + hi].tolist()]
            epoch, step = epoch + 1, 0

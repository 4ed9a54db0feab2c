"""DataLoaders for the sample order in `data.sampler`."""

from __future__ import annotations

from typing import List

import torch
from torch.utils.data import DataLoader, Dataset

from data.sampler import Key


def make_loader(dataset: Dataset, batch_sampler: torch.utils.data.Sampler | List[List[Key]],
                num_workers: int, prefetch_factor: int, pin_memory: bool) -> DataLoader:
    """Workers persist across epochs (the sampler never ends, and eval reuses its workers),
    and each keeps `prefetch_factor` batches decoded ahead of the loop."""
    extra = {}
    if num_workers > 0:
        extra = {"persistent_workers": True, "prefetch_factor": prefetch_factor}
    return DataLoader(dataset, batch_sampler=batch_sampler, num_workers=num_workers,
                      pin_memory=pin_memory, **extra)


def eval_batches(dataset_size: int, batch_size: int, rank: int = 0,
                 world_size: int = 1) -> List[List[Key]]:
    """Every sample once, in order; rank r takes indices r, r+W, ... (eval has no epochs)."""
    mine = list(range(rank, dataset_size, world_size))
    return [[(0, i) for i in mine[s:s + batch_size]] for s in range(0, len(mine), batch_size)]

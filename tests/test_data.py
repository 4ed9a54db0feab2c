"""Sample order and augmentation: pure functions of (seed, epoch, index), rank-agnostic."""

from __future__ import annotations

import itertools

import pytest
import torch

from data.dataset import normalize
from data.errors import DatasetError
from data.index import list_split
from data.loader import VolumeLoader, eval_batches
from data.pipeline import open_dataset
from data.sampler import BatchPlan, GlobalBatchSampler
from data.volume import Volume


def take_steps(sampler: GlobalBatchSampler, steps: int):
    """This rank's indices per optimizer step (micro-batches joined)."""
    it = iter(sampler)
    per_step = sampler.plan.grad_accum_steps
    return [[k for micro in itertools.islice(it, per_step) for k in micro] for _ in range(steps)]


@pytest.mark.parametrize("accum", [1, 2])
def test_global_batches_do_not_depend_on_world_size(accum):
    size, batch = 103, 12  # 8 steps per epoch, 7 samples dropped
    reference = None
    for world in (1, 2, 3):
        plan = BatchPlan(size, batch, world_size=world, grad_accum_steps=accum)
        ranks = [take_steps(GlobalBatchSampler(plan, seed=5, rank=r), 16) for r in range(world)]
        global_batches = [sum((ranks[r][s] for r in range(world)), []) for s in range(16)]
        if reference is None:
            reference = global_batches
        assert global_batches == reference
    epoch0 = [i for e, i in sum(reference[:8], [])]
    assert {e for e, _ in sum(reference[:8], [])} == {0}
    assert len(epoch0) == len(set(epoch0)) == 96  # every kept index exactly once
    assert BatchPlan(size, batch).dropped_per_epoch == 7
    assert [i for _, i in sum(reference[8:], [])] != epoch0  # a new order each epoch


def test_starting_mid_epoch_continues_the_same_order():
    plan = BatchPlan(50, 10, world_size=2)
    full = take_steps(GlobalBatchSampler(plan, seed=1, rank=1), 12)
    resumed = take_steps(GlobalBatchSampler(plan, seed=1, rank=1, start_epoch=1, start_step=2), 5)
    assert resumed == full[7:12]


def test_batch_size_must_divide_by_world_size_times_accumulation():
    with pytest.raises(DatasetError, match="multiple of 6"):
        BatchPlan(100, 16, world_size=3, grad_accum_steps=2)
    with pytest.raises(DatasetError, match="exceeds"):
        BatchPlan(10, 16)


def test_augmentation_is_per_sample_and_leaves_the_global_rng_alone(tiny_root):
    ds = open_dataset(Volume(str(tiny_root)), "train", None, 24, train=True, seed=3)
    state = torch.get_rng_state()
    a, label, index, _ = ds[(0, 5)]
    assert torch.equal(torch.get_rng_state(), state)
    assert (a.shape, a.dtype, label, index) == ((3, 24, 24), torch.uint8,
                                                ds.index.labels[5], 5)
    assert torch.equal(ds[(0, 5)][0], a)
    assert not torch.equal(ds[(1, 5)][0], a)  # another epoch, another crop
    other_seed = open_dataset(Volume(str(tiny_root)), "train", None, 24, train=True, seed=4)
    assert not torch.equal(other_seed[(0, 5)][0], a)


def test_workers_deliver_the_same_batches_as_the_main_process(tiny_root):
    ds = open_dataset(Volume(str(tiny_root)), "train", None, 24, train=True, seed=0)
    plan = BatchPlan(len(ds), 20)
    batches = {}
    for workers in (0, 2):
        loader = VolumeLoader(ds, GlobalBatchSampler(plan, seed=0), workers, 2)
        batches[workers] = list(itertools.islice(iter(loader), 8))  # crosses an epoch
    for a, b in zip(batches[0], batches[2]):
        assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_eval_batches_cover_every_sample_once_over_ranks():
    seen = [i for r in range(3) for b in eval_batches(31, 4, r, 3) for _, i in b]
    assert sorted(seen) == list(range(31))


def test_index_errors_name_the_path(tmp_path):
    volume = Volume(str(tmp_path))
    with pytest.raises(DatasetError, match="missing does not exist"):
        list_split(volume, "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DatasetError, match="no class folders"):
        list_split(volume, "empty")
    (tmp_path / "empty" / "cat").mkdir()
    with pytest.raises(DatasetError, match="cat holds no images"):
        list_split(volume, "empty")


def test_normalize_maps_uint8_to_standardized_float():
    x = torch.full((1, 3, 2, 2), 255, dtype=torch.uint8)
    y = normalize(x, mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5))
    assert y.dtype == torch.float32 and torch.allclose(y, torch.ones_like(y))

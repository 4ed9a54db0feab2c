"""The data path end to end in one process: exact-once over ranks and workers, bit-exact
resume on another world size, bad files skipped deterministically, volume errors; and runs
sharing the node-wide default cache."""

from __future__ import annotations

import itertools
import logging
import os
import shutil
from pathlib import Path
from typing import Dict, List, Optional

import pytest
import torch

from data.cache import NodeCache
from data.errors import DatasetError, OnBadFile
from data.loader import Batch, VolumeLoader
from data.pipeline import open_dataset
from data.sampler import BatchPlan, GlobalBatchSampler, epoch_permutation
from data.volume import Volume
from support.launch import PYTHON, finish, launch
from support.runs import tiny_overrides
from support.logs import our_records

SEED = 7
BAD = {  # file -> what is wrong with it; all are in the train split of `flawed_root`
    "train/circle/0000000.jpg": "truncated",
    "train/ring/0000001.jpg": "corrupt",
    "train/star/0000004.jpg": "png",
}


@pytest.fixture(scope="module")
def flawed_root(tiny_root: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny dataset with a truncated, a corrupt and a non-JPEG file among its JPEGs."""
    root = tmp_path_factory.mktemp("flawed") / "shapes"
    shutil.copytree(tiny_root, root)
    for name, kind in BAD.items():
        path = root / name
        data = path.read_bytes()
        if kind == "truncated":
            path.write_bytes(data[:len(data) // 2])
        elif kind == "corrupt":
            path.write_bytes(b"\xff\xd8" + bytes(range(256)) * 2 + b"\xff\xd9")
        else:
            path.write_bytes(b"\x89PNG\r\n\x1a\n" + data[8:])
    return root


def dataset(root: Path, cache_dir: Optional[Path] = None, **kwargs):
    cache = NodeCache(cache_dir, 10 ** 9) if cache_dir else None
    return open_dataset(Volume(str(root), retries=2, backoff_seconds=0.01), "train", cache,
                        24, train=True, seed=SEED, **kwargs)


def global_steps(root: Path, cache_dir: Optional[Path], world: int, workers: int,
                 steps: int, start_step: int = 0, global_batch: int = 18) -> List[Batch]:
    """Each global step's batch, ranks' slices joined in rank order (as one would gather)."""
    ds = dataset(root, cache_dir)
    plan = BatchPlan(len(ds), global_batch, world_size=world)
    epoch, step = divmod(start_step, plan.steps_per_epoch)
    per_rank = []
    for rank in range(world):
        sampler = GlobalBatchSampler(plan, SEED, rank, start_epoch=epoch, start_step=step)
        loader = VolumeLoader(ds, sampler, workers, prefetch_factor=2, prefetch_threads=2,
                              prefetch_batches=2)
        per_rank.append(list(itertools.islice(iter(loader), steps)))
    return [Batch(*(torch.cat([per_rank[r][s][f] for r in range(world)]) for f in range(3)),
                  sum(per_rank[r][s].stats for r in range(world)))
            for s in range(steps)]


def name_of(ds, i: int) -> str:
    return ds.index.name(int(i))


def test_one_epoch_covers_every_readable_sample_once_for_any_world_and_workers(
        flawed_root, tmp_path):
    ds = dataset(flawed_root)
    plan = BatchPlan(len(ds), 18)  # 6 steps, 12 samples dropped per epoch
    reference = None
    for world, workers in itertools.product((1, 2, 3), (0, 2)):
        steps = global_steps(flawed_root, tmp_path / "cache", world, workers,
                             plan.steps_per_epoch)
        indices = [b.indices.tolist() for b in steps]
        seen = [i for step in indices for i in step]
        assert len(seen) == len(set(seen)), (world, workers)  # nothing twice
        if reference is None:
            reference = indices
        assert indices == reference, (world, workers)  # the same global batches, in order
    # Exactly the readable samples of the full global batches: the permutation's first
    # steps x 18 entries, less the bad files among them.
    full = epoch_permutation(SEED, 0, len(ds))[:plan.steps_per_epoch * 18].tolist()
    readable = {i for i in full if name_of(ds, i) not in BAD}
    assert {i for step in reference for i in step} == readable
    assert len(readable) < len(full)  # the dataset's bad files did land in this epoch


@pytest.mark.parametrize("stop, world, workers", [(2, 3, 2), (6, 3, 0), (8, 2, 2)])
def test_resume_on_another_world_size_gives_the_same_samples_and_pixels(
        flawed_root, tmp_path, stop, world, workers):
    total = 12  # two epochs of 6 steps
    full = global_steps(flawed_root, tmp_path / "a", 1, 0, total)
    resumed = global_steps(flawed_root, tmp_path / "b", world, workers, total - stop,
                           start_step=stop)
    for a, b in zip(full[stop:], resumed):
        assert torch.equal(a.indices, b.indices)
        assert torch.equal(a.labels, b.labels)
        assert torch.equal(a.images, b.images)  # bit for bit: same crops and flips
    # The control: resuming one step later must not match, or this test could not fail.
    shifted = global_steps(flawed_root, tmp_path / "b", world, workers, 1, start_step=stop + 1)
    assert not torch.equal(full[stop].indices, shifted[0].indices)


def test_bad_files_are_skipped_with_a_warning_once_and_counted(flawed_root, tmp_path,
                                                               caplog):
    ds = dataset(flawed_root, tmp_path / "cache")
    bad = [i for i in range(len(ds)) if name_of(ds, i) in BAD]
    with caplog.at_level(logging.WARNING, logger="data.dataset"):
        for epoch in (0, 1):
            samples = [ds[(epoch, i)] for i in bad]
            assert [s.image for s in samples] == [None] * len(BAD)
    warnings = [r.getMessage() for r in our_records(caplog)]
    assert len(warnings) == len(BAD)  # once per file, not once per epoch
    for reason in ("truncated JPEG", "corrupt JPEG", "not a JPEG"):
        assert sum(reason in w for w in warnings) == 1, warnings
    loader = VolumeLoader(ds, [[(0, i) for i in bad + [bad[0] + 1]]], 0)
    batch = next(iter(loader))
    assert batch.stats.tolist()[3] == len(BAD) and batch.indices.tolist() == [bad[0] + 1]


def test_on_bad_file_fail_names_the_file_and_the_switch(flawed_root):
    ds = dataset(flawed_root, on_bad_file=OnBadFile.fail)
    bad = next(i for i in range(len(ds)) if name_of(ds, i) == "train/circle/0000000.jpg")
    with pytest.raises(DatasetError, match="circle/0000000.jpg: truncated JPEG.*"
                                           "data.on_bad_file=skip"):
        ds[(0, bad)]
    # Raised in a worker process, the error is still one line in the main process.
    loader = VolumeLoader(ds, [[(0, bad)]], 1)
    with pytest.raises(DatasetError) as err:
        next(iter(loader))
    assert "\n" not in str(err.value) and "truncated JPEG" in str(err.value)


def test_a_file_gone_from_the_volume_is_a_bad_file_not_a_crash(flawed_root, tmp_path):
    root = tmp_path / "shapes"
    shutil.copytree(flawed_root, root)
    ds = dataset(root)
    (root / ds.index.name(3)).unlink()  # after indexing, as a concurrent delete would
    sample = ds[(0, 3)]
    assert sample.image is None and ds[(0, 4)].image is not None


def test_an_unreadable_file_is_skipped_with_its_reason(tiny_root, tmp_path):
    root = tmp_path / "shapes"
    shutil.copytree(tiny_root, root)
    ds = dataset(root)
    path = root / ds.index.name(2)
    path.chmod(0)
    if os.geteuid() == 0:
        # root reads anything: drop privileges in a real child process to hit EACCES.
        tmp_path.chmod(0o755)
        for parent in tmp_path.parents:
            parent.chmod(parent.stat().st_mode | 0o005)
        ctx = torch.multiprocessing.get_context("fork")
        queue = ctx.SimpleQueue()
        child = ctx.Process(target=_read_as_nobody, args=(ds, 2, queue))
        child.start()
        child.join()
        assert child.exitcode == 0
        result = queue.get()
    else:
        result = _problem_of(ds, 2)
    assert "PermissionError" in result, result


def _problem_of(ds, i: int) -> str:
    try:
        ds.fetch(i)
    except Exception as err:  # the test wants the type name, whatever it is
        return f"{type(err).__name__}: {err} (cause {type(err.__cause__).__name__})"
    return "read fine"


def _read_as_nobody(ds, i: int, queue) -> None:
    os.setgid(65534)
    os.setuid(65534)
    queue.put(_problem_of(ds, i))


def test_transient_volume_errors_are_retried_not_skipped(tiny_root, monkeypatch):
    monkeypatch.setenv("GOODPUT_SLOWFS_LATENCY_MS", "0")
    monkeypatch.setenv("GOODPUT_SLOWFS_FAIL_FIRST", "2")  # two failures, then success
    ds = open_dataset(Volume(f"slow://{tiny_root}", retries=2, backoff_seconds=0.001),
                      "train", None, 24, train=True, seed=SEED)
    reference = dataset(tiny_root)[(0, 9)]
    sample = ds[(0, 9)]
    assert sample.image is not None and torch.equal(sample.image, reference.image)
    # More failures than retries: one clear error, never a skip.
    monkeypatch.setenv("GOODPUT_SLOWFS_FAIL_FIRST", "10")
    with pytest.raises(DatasetError, match=r"failed 3 times .*ConnectionResetError.*"
                                           r"data.read_retries"):
        ds[(0, 10)]


def test_batches_are_identical_with_and_without_the_cache(tiny_root, tmp_path):
    cached = global_steps(tiny_root, tmp_path / "cache", 1, 2, 3)
    again = global_steps(tiny_root, tmp_path / "cache", 1, 2, 3)  # warm now
    direct = global_steps(tiny_root, None, 1, 0, 3)
    for a, b, c in zip(cached, again, direct):
        assert torch.equal(a.images, c.images) and torch.equal(b.images, c.images)
    stats: Dict[str, int] = {"lookups": 0, "hits": 0}
    for b in again:
        stats["lookups"] += int(b.stats[0])
        stats["hits"] += int(b.stats[1])
    assert stats["hits"] == stats["lookups"] == 54
    assert sum(int(b.stats[1]) for b in direct) == 0


def test_runs_share_the_default_node_cache_and_a_local_root_is_not_cached(tiny_root,
                                                                          tmp_path):
    """Two runs at once on a remote root share the default cache (XDG_CACHE_HOME): every
    file leaves the volume once in all. A run on a root on local disk reads it in place and
    adds nothing to the cache."""
    reads, cache = tmp_path / "reads.log", tmp_path / "xdg" / "goodput-trainer"
    env = dict(XDG_CACHE_HOME=str(tmp_path / "xdg"), GOODPUT_SLOWFS_LOG=str(reads),
               GOODPUT_SLOWFS_LATENCY_MS="1")

    def train(root: str, name: str):
        return launch(PYTHON, ["-m", "train", *tiny_overrides(root), "model=tiny_cnn",
                               "logger=none", "trainer.device=cpu", "checkpoint.enabled=false",
                               f"run.root={tmp_path / 'runs'}", f"run.name={name}"],
                      cwd=tmp_path, **env)

    runs = [train(f"slow://{tiny_root}", name) for name in ("a", "b")]
    for run in runs:
        out = finish(run)
        assert run.returncode == 0, out[-3000:]
        assert "is a URL: caching it" in out
    files = sorted(str(p) for p in tiny_root.rglob("*.jpg"))
    assert sorted(reads.read_text().splitlines()) == files  # each once, over both runs
    before = sorted(p.relative_to(cache) for p in cache.rglob("*") if p.is_file())
    assert len(list((cache / "index").iterdir())) == 2  # train and val

    local = train(str(tiny_root), "c")
    out = finish(local)
    assert local.returncode == 0, out[-3000:]
    assert "is on " in out and "(local): reading it in place, no cache" in out
    assert sorted(p.relative_to(cache) for p in cache.rglob("*") if p.is_file()) == before

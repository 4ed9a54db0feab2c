"""Costs that must not grow faster than the work: rank 0's storage requests per rank when it
checks a checkpoint, checksums read once per process. (How fast they are is measured by
benchmarks/scale.py, not here.)"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from checkpointing import commit, verify
from checkpointing.checksums import WRITE_ALGORITHM, hasher
from checkpointing.commit import FileRecord
from checkpointing.manager import CheckpointManager, CheckpointOptions
from checkpointing.storage import Store
from support.tiny_job import Job, manager

STORAGE_CALLS = ("listdir", "entries", "exists", "is_regular_file", "size", "checksum",
                 "read_bytes")


class CountingStore(Store):
    """A Store that counts the requests it makes, by method and path."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.calls: Counter = Counter()
        for name in STORAGE_CALLS:
            if hasattr(self, name):
                setattr(self, name, self._counted(name, getattr(self, name)))

    def _counted(self, name, method):
        def call(*args, **kwargs):
            self.calls[name, str(args[0]) if args else ""] += 1
            return method(*args, **kwargs)

        return call


def many_rank_checkpoint(root: Path, ranks: int, step: int = 7) -> str:
    """A step directory as `ranks` ranks leave it: a shard and a marker each, rank 0's
    marker listing `.metadata` too (not unpickled when contents are not read)."""
    name = commit.step_dir_name(step)
    (root / name).mkdir(parents=True)
    store = Store(str(root))
    for rank in range(ranks):
        files = {f"__{rank}_0.distcp": bytes([rank % 256]) * 16}
        if rank == 0:
            files[".metadata"] = b"metadata"
        records = {}
        for file, data in files.items():
            (root / name / file).write_bytes(data)
            digest = hasher(WRITE_ALGORITHM)
            digest.update(data)
            records[file] = FileRecord(len(data), digest.hexdigest(), WRITE_ALGORITHM)
        commit.write_marker(store, name, step, rank, ranks, records)
    return name


def test_checking_a_checkpoint_makes_one_request_per_rank_and_one_listing(tmp_path):
    ranks = 64
    name = many_rank_checkpoint(tmp_path, ranks)
    store = CountingStore(str(tmp_path))
    assert commit.verify(store, name, 7, read_contents=False) == ranks
    assert sum(store.calls.values()) <= ranks + 1, store.calls.most_common(4)
    assert all(n == 1 for n in store.calls.values())  # no path asked twice
    # reading the contents adds one read of each file (and unpickles `.metadata`, here
    # never reached: a shard is altered)
    (tmp_path / name / "__3_0.distcp").write_bytes(b"x" * 16)
    store.calls.clear()
    ok, line = verify.check(store, name, 7)
    assert not ok and "__3_0.distcp does not match its checksum" in line
    assert sum(n for (call, _), n in store.calls.items() if call != "checksum") <= ranks + 1


def test_a_broken_many_rank_checkpoint_says_why_in_one_line(tmp_path):
    name = many_rank_checkpoint(tmp_path, 16)
    (tmp_path / name / "__5_0.distcp").unlink()
    (tmp_path / name / "commit_rank_9.json").unlink()
    ok, line = verify.check(Store(str(tmp_path)), name, 7)
    assert not ok and "commit marker of rank(s) [9] missing" in line
    (tmp_path / name / "commit_rank_09.json").write_text("{}")  # not any rank's marker name
    ok, line = verify.check(Store(str(tmp_path)), name, 7)
    assert not ok and "commit_rank_9.json is missing" in line


def test_a_resumed_process_reads_each_checkpoint_once(tmp_path, monkeypatch):
    # Resume verifies the newest checkpoint's checksums; the retention after the next save
    # must not read those bytes again (at a billion parameters, 12 GB on rank 0 alone).
    job, root = Job(), tmp_path / "ckpt"
    mgr = manager(root, async_mode="off", keep_last=2)
    for step in (1, 2):
        mgr.save(step, job.state())
    mgr.close()
    reads: Counter = Counter()
    checksum = Store.checksum

    def counted(self, path, algorithm):
        reads[path] += 1
        return checksum(self, path, algorithm)

    monkeypatch.setattr(Store, "checksum", counted)
    resumed = manager(root, async_mode="off", keep_last=2)
    assert resumed.load_latest(Job(seed=1).state()).step == 2
    resumed.save(3, job.state())
    resumed.close()
    assert reads and max(reads.values()) == 1, reads.most_common(3)
    assert sorted(p.name for p in root.iterdir()) == ["step_000000002", "step_000000003"]


def test_a_resume_builds_no_python_list_of_the_whole_epoch():
    # ImageNet-sized: the first batch after a resume (and each epoch's) must not hold a
    # Python int per sample of the epoch (36 bytes each, 46 MB per rank) in the sampler.
    import tracemalloc

    from data.sampler import BatchPlan, GlobalBatchSampler, SplitBatchSampler, epoch_permutation

    size, plan = 1_281_167, BatchPlan(1_281_167, 256, world_size=8)
    expected = epoch_permutation(0, 2, size)[7 * 256 + 3 * 32:][:32].tolist()
    for sampler in (GlobalBatchSampler(plan, seed=0, rank=3, start_epoch=2, start_step=7),
                    SplitBatchSampler(plan, seed=0, part=3, parts=8, start_epoch=2,
                                      start_step=7)):
        tracemalloc.start()
        try:
            batch = next(iter(sampler))
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert batch == [(2, i) for i in expected]
        assert peak < 1 << 20, peak  # a megabyte: a batch's worth, not an epoch's


def test_an_eviction_scans_the_cache_without_holding_the_state_lock(tmp_path, monkeypatch):
    # Statting every entry of a million-entry cache takes seconds; under the state lock,
    # every fill and eviction of the node would wait for it.
    import errno
    import fcntl
    import os

    from data.cache import FOOTER, NodeCache

    cache = NodeCache(tmp_path, limit_bytes=20 * (100 + FOOTER.size))
    for i in range(20):
        cache.ensure(f"k{i}", lambda: b"x" * 100)
    scan, held = NodeCache._scan, []

    def scan_noting_the_lock(self):
        fd = os.open(self.root / "state.lock", os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            fcntl.flock(fd, fcntl.LOCK_UN)
            held.append(False)
        except OSError as err:
            assert err.errno in (errno.EWOULDBLOCK, errno.EAGAIN)
            held.append(True)
        finally:
            os.close(fd)
        return scan(self)

    monkeypatch.setattr(NodeCache, "_scan", scan_noting_the_lock)
    for i in range(20, 30):
        cache.ensure(f"k{i}", lambda: b"y" * 100)
    assert held and not any(held), held
    assert cache.usage_bytes() <= cache.limit_bytes
    files = [p for p in (tmp_path / "objects").rglob("*") if p.is_file()]
    assert cache.usage_bytes() == sum(p.stat().st_size for p in files)
    assert (cache.get("k29", lambda: b"")[1]).hit  # the newest fills stayed


def test_a_save_to_an_object_store_reads_each_marker_once(tmp_path, monkeypatch):
    """Rank 0's commit on a store without rename (an object store: each rank uploads
    straight into `step_X/`) reads every rank's marker to know it is this attempt's; the
    check before retention trusts the save uses those, rather than a second request per
    rank per save. Played on a local directory told it cannot rename."""
    reads: Counter = Counter()
    read_bytes = Store.read_bytes

    def counted(self, path):
        if self.url == str(tmp_path / "bucket"):
            reads[Path(path).name] += 1
        return read_bytes(self, path)

    monkeypatch.setattr(Store, "read_bytes", counted)
    mgr = CheckpointManager(CheckpointOptions(dir=str(tmp_path / "bucket"),
                                              staging_dir=str(tmp_path / "stage"),
                                              async_mode="off"))
    mgr.remote.renames = False
    job = Job()
    for step in (1, 2):
        reads.clear()
        assert mgr.save(step, job.state()).result().committed
        assert reads[commit.marker_name(0)] == 1, reads
    mgr.close()
    assert [s for s, _ in commit.find_complete(Store(str(tmp_path / "bucket")))] == [2, 1]


def test_a_file_two_markers_list_makes_the_checkpoint_incomplete(tmp_path):
    """Each rank lists its own files: a name in two markers (with the same record or not)
    leaves no one record to trust, whatever order the markers are read in."""
    name = many_rank_checkpoint(tmp_path, 4)
    store = Store(str(tmp_path))
    marker = tmp_path / name / commit.marker_name(2)
    body = json.loads(marker.read_text())
    body["files"]["__1_0.distcp"] = json.loads(
        (tmp_path / name / commit.marker_name(1)).read_text())["files"]["__1_0.distcp"]
    marker.write_text(json.dumps(body))
    ok, line = verify.check(store, name, 7)
    assert not ok and "__1_0.distcp is listed by more than one commit marker" in line, line

"""Cost as the work grows: files, ranks, run length, state size; each curve's growth.

    python benchmarks/scale.py                     # every curve, then docs/scale.png
    python benchmarks/scale.py --only run,ranks    # some of them (run, ranks, torchrun,
                                                   #  files, s3, cache, state)

Each curve is measured at (at least) three sizes a decade apart and printed with its fitted
growth: the exponent b of cost ~ size^b (a least-squares line through the log-log points;
0 is flat, 1 linear). What cannot run here is simulated: a month of events at 1,024 ranks
is written as the trainer writes it; a checkpoint of 4,096 ranks is what that many ranks
leave in a step directory (markers, `.metadata` entries, tiny shards), and rank 0's part of
commit, retention, verification and resume's discovery is timed over it.

Everything is written under `--work` (default: a temporary directory) and removed at the end.
This file is run as a script (not `-m`): torchrun starts it again in new processes.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Dict, Iterator, List, Sequence, Tuple

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

if TYPE_CHECKING:
    import s3fs

    from common.seaweedfs import SeaweedFS

DAY = 86_400


@dataclass
class Curve:
    """One cost measured at several sizes."""

    name: str
    size_unit: str
    cost_unit: str
    fit_from: float = 0.0  # sizes below are printed and drawn, not fitted
    sizes: List[float] = field(default_factory=list)
    costs: List[float] = field(default_factory=list)

    def add(self, size: float, cost: float) -> None:
        self.sizes.append(size)
        self.costs.append(cost)
        print(f"  {self.name}: {size:,.4g} {self.size_unit} -> {cost:.4g} {self.cost_unit}",
              flush=True)

    def exponent(self) -> float:
        """b of cost ~ size^b, least squares over the log-log points."""
        fitted = [(s, c) for s, c in zip(self.sizes, self.costs) if s >= self.fit_from]
        xs = [math.log(s) for s, _ in fitted]
        ys = [math.log(max(c, 1e-12)) for _, c in fitted]
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        var = sum((x - mx) ** 2 for x in xs)
        return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else 0.0

    def at(self, size: float) -> float:
        """The fitted power law, extrapolated to `size`."""
        b = self.exponent()
        return self.costs[-1] * (size / self.sizes[-1]) ** b


def timed(fn: Callable[[], object]) -> float:
    began = time.perf_counter()
    fn()
    return time.perf_counter() - began


# Runs a module as `python -m` does, then prints its peak resident memory (VmHWM: of this
# address space alone; getrusage's maximum also counts the parent's, inherited by the fork).
PEAK = ("import runpy, sys\n"
        "sys.argv = sys.argv[1:]\n"
        "try:\n"
        "    runpy.run_module(sys.argv[0], run_name='__main__', alter_sys=True)\n"
        "finally:\n"
        "    hwm = [l for l in open('/proc/self/status') if l.startswith('VmHWM')][0]\n"
        "    print('PEAK', hwm.split()[1], file=sys.stderr)\n")


def child(module: str, args: Sequence[str]) -> Tuple[float, float]:
    """(seconds, peak resident MB) of `python -m module args` in a process of its own."""
    began = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", PEAK, module, *args], capture_output=True,
                          text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    seconds = time.perf_counter() - began
    peak = [line for line in proc.stderr.splitlines() if line.startswith("PEAK ")]
    # A module without a `__main__` guard runs nothing and prints nothing: not a measurement
    if proc.returncode != 0 or not peak or not proc.stdout.strip():
        raise RuntimeError(f"python -m {module} failed or printed nothing ({proc.returncode}):"
                           f" {proc.stderr[-500:]}")
    return seconds, int(peak[-1].split()[1]) / 1024


# ---- run length: a month of events --------------------------------------------------------

@dataclass(frozen=True)
class Month:
    """A simulated run: `days` at one step a second on `ranks` ranks, logging every
    `log_every` steps, saving every `interval` steps, failing every `mtbf_hours` (the
    whole job's: a 4-year GPU MTBF over 1,024 GPUs is 34 h)."""

    days: float
    ranks: int = 1024
    log_every: int = 10
    interval: int = 100
    mtbf_hours: float = 34.0
    restart_seconds: float = 600.0


def write_events(run_dir: Path, m: Month, seed: int = 0) -> Dict[str, float]:
    """`run_dir/events.jsonl` and `goodput.json` as the trainer writes them for `m`: every
    rank's start, first step, resume and exit; rank 0's progress and saves; a kill (no
    exits) at each failure. Returns what it wrote: lines, bytes, attempts, saves, and the
    exact totals the report must find."""
    rng = random.Random(seed)
    run_dir.mkdir(parents=True, exist_ok=True)
    t, step, end_step = 1.7e9, 0, int(m.days * DAY)
    attempts = committed = lines = 0
    with open(run_dir / "events.jsonl", "w") as f:
        def put(kind: str, at: float, rank: int, attempt: str, **fields: object) -> None:
            nonlocal lines
            f.write(json.dumps({"kind": kind, "time": round(at, 3), "rank": rank,
                                "pid": 1000 + attempts * m.ranks + rank, "attempt": attempt,
                                "restart": 0,
                                **fields}, separators=(",", ":")) + "\n")
            lines += 1

        resumed = 0
        while True:
            attempt = f"{attempts:08x}"
            attempts += 1
            for r in range(m.ranks):
                put("start", t, r, attempt, world_size=m.ranks, host=f"node{r // 8:04d}")
            t += 30.0
            if resumed:
                for r in range(m.ranks):
                    put("resume", t, r, attempt, step=resumed, seconds=20.0)
            step = resumed
            for r in range(m.ranks):
                put("first_step", t, r, attempt, step=step + 1)
            failure = t + rng.expovariate(1 / (m.mtbf_hours * 3600))
            staged = None  # (step, time) of the save in flight
            while step < end_step and t + 1 < failure:
                step += 1
                t += 1.0
                if step % m.log_every == 0:
                    put("progress", t, 0, attempt, step=step)
                if step % m.interval == 0 or step == end_step:
                    if staged:  # the previous save landed meanwhile
                        put("save_committed", staged[1] + 8.0, 0, attempt, step=staged[0],
                            seconds=8.0)
                        committed += 1
                        resumed = staged[0]
                    put("save_staged", t, 0, attempt, step=step, stall=0.05)
                    staged = (step, t)
            if step >= end_step:
                put("save_committed", t + 8, 0, attempt, step=step, seconds=8.0)
                put("end", t + 8, 0, attempt, step=step)
                for r in range(m.ranks):
                    put("exit", t + 9, r, attempt, code=0)
                committed += 1
                break
            # killed, no exits: the save in flight counts if it landed before the kill
            if staged and failure - staged[1] >= 8.0:
                resumed = staged[0]
                committed += 1
            t = failure + m.restart_seconds
    total = t + 9 - 1.7e9
    seconds = {"compute": total * 0.9, "data_wait": total * 0.02, "checkpoint_stall": 1.0,
               "restore": 600.0 * attempts, "lost": total * 0.05}
    (run_dir / "goodput.json").write_text(json.dumps(
        {"seconds": seconds, "reached": end_step, "counted_steps": end_step,
         "saved_at": 1.7e9 + total, "ended": True}))
    return {"lines": lines, "bytes": (run_dir / "events.jsonl").stat().st_size,
            "attempts": attempts, "committed": committed}


# ---- ranks: what rank 0 does with a checkpoint of many ranks --------------------------

SHARDED_TENSORS = 8  # tensors each rank holds a chunk of (FSDP: every parameter)


def write_checkpoint(directory: Path, step: int, ranks: int) -> None:
    """What `ranks` ranks leave in a step directory: each rank's shard file (tiny chunks of
    SHARDED_TENSORS tensors) and commit marker, and rank 0's `.metadata` listing every
    chunk; checksums as the writer takes them."""
    import pickle

    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata,
                                                       MetadataIndex, StorageMeta,
                                                       TensorProperties, TensorStorageMetadata)

    from checkpointing import commit
    from checkpointing.checksums import WRITE_ALGORITHM, hasher
    from checkpointing.commit import FileRecord
    from checkpointing.storage import Store
    from checkpointing.writer import RAW

    directory.mkdir(parents=True)
    store = Store(str(directory.parent))
    chunk = 4  # float32 elements per rank and tensor
    storage, tensors = {}, {}
    records: Dict[int, Dict[str, FileRecord]] = {}
    for r in range(ranks):
        name = f"__{r}_0.distcp"
        data = bytes(range(256))[: 4 * chunk] * SHARDED_TENSORS
        (directory / name).write_bytes(data)
        digest = hasher(WRITE_ALGORITHM)
        digest.update(data)
        records[r] = {name: FileRecord(len(data), digest.hexdigest(), WRITE_ALGORITHM)}
        for t in range(SHARDED_TENSORS):
            storage[MetadataIndex(f"model.w{t}", [r * chunk], 0)] = _StorageInfo(
                name, t * 4 * chunk, 4 * chunk, [RAW])
    for t in range(SHARDED_TENSORS):
        tensors[f"model.w{t}"] = TensorStorageMetadata(
            TensorProperties(dtype=torch.float32), torch.Size([ranks * chunk]),
            [ChunkStorageMetadata(torch.Size([r * chunk]), torch.Size([chunk]))
             for r in range(ranks)])
    # DCP records where it saved (so two steps' files differ, as in a real run)
    metadata = pickle.dumps(Metadata(tensors, storage_data=storage, storage_meta=StorageMeta(
        checkpoint_id=str(directory))))
    (directory / ".metadata").write_bytes(metadata)
    digest = hasher(WRITE_ALGORITHM)
    digest.update(metadata)
    records[0][".metadata"] = FileRecord(len(metadata), digest.hexdigest(), WRITE_ALGORITHM)
    for r in range(ranks):
        commit.write_marker(store, directory.name, step, r, ranks, records[r])


def rank0_costs(work: Path, ranks: int, keep: int = 3) -> Dict[str, float]:
    """Seconds rank 0 spends on a checkpoint of `ranks` ranks: the commit (wait for every
    marker, rename, check what was written), retention over `keep` + 1 checkpoints (in
    the process that wrote them, and in a fresh one: after a resume), verification
    (`python -m checkpointing.verify`'s check) and resume's discovery of the newest."""
    from checkpointing import commit
    from checkpointing.manager import CheckpointManager, CheckpointOptions
    from checkpointing.safe_load import MetadataUnpickler, load_metadata
    from checkpointing.storage import Store
    from checkpointing.verify import scrub

    root = work / f"ckpt-{ranks}"
    shutil.rmtree(root, ignore_errors=True)
    steps = [100 * (i + 1) for i in range(keep + 1)]
    for step in steps[:-1]:
        write_checkpoint(root / commit.step_dir_name(step), step, ranks)
    partial = commit.partial_dir_name(steps[-1], "bench")
    write_checkpoint(root / partial, steps[-1], ranks)
    store = Store(str(root))
    manager = CheckpointManager(CheckpointOptions(dir=str(root), keep_last=keep),
                                rank=0, world_size=ranks)
    manager.attempt = "bench"
    for step in steps[:-1]:  # this process saved them: verified when they were committed
        manager._verified.add((store.url, step))
    costs = {}

    def commit_it() -> None:
        markers = manager._wait_for_markers(partial, steps[-1])
        manager._rename_into_place(store, partial, steps[-1])
        manager._trust_what_was_written(steps[-1], markers)

    costs["commit"] = timed(commit_it)
    costs["retention"] = timed(lambda: manager.apply_retention(steps[-1]))
    fresh = CheckpointManager(CheckpointOptions(dir=str(root), keep_last=keep), rank=0,
                              world_size=ranks)
    costs["retention, fresh process"] = timed(lambda: fresh.apply_retention(steps[-1]))
    costs["verify"] = timed(lambda: scrub(store))
    # Resume's check is shared by the ranks: rank 0's part is the markers, its share of
    # the checksums (1/ranks of the files) and `.metadata` (group=None: no collectives).
    costs["resume discovery"] = timed(lambda: next(fresh.complete_checkpoints()))
    data = (root / commit.step_dir_name(steps[-1]) / ".metadata").read_bytes()
    costs["metadata unpickle"] = timed(lambda: load_metadata(io.BytesIO(data)))
    # before: the reference unpickler alone, the garbage collector running
    costs["metadata unpickle, before"] = timed(
        lambda: MetadataUnpickler(io.BytesIO(data)).load())
    costs["metadata MB"] = (root / commit.step_dir_name(steps[-1]) / ".metadata").stat().st_size / 1e6
    shutil.rmtree(root)
    return costs


# ---- files: listing, the index, the sampler, the node cache ------------------------------

def tree_files(files: int) -> Iterator[Tuple[str, str]]:
    """(class folder, file name) of each of `files` files of a split, 1,000 classes as
    ImageNet's (fewer for small trees), each class's files together."""
    classes = max(1, min(1000, files // 100))
    for c in range(classes):
        for i in range(c * files // classes, (c + 1) * files // classes):
            yield f"n{c:08d}", f"n{c:08d}_{i}.JPEG"


def make_tree(root: Path, files: int) -> Path:
    """`root/train/<class>/<file>.JPEG` (`tree_files`), empty files (the listing reads no
    bytes; an empty file takes an inode, no block)."""
    folder = None
    for cls, name in tree_files(files):
        if folder is None or folder.name != cls:
            folder = root / "train" / cls
            folder.mkdir(parents=True)
        os.close(os.open(folder / name, os.O_CREAT | os.O_WRONLY, 0o644))
    return root


def private_kb() -> int:
    """This process's private (copied, not shared) resident memory, KB."""
    with open("/proc/self/smaps_rollup") as f:
        fields = dict(line.split(":", 1) for line in f if ":" in line)
    return sum(int(fields[k].split()[0]) for k in ("Private_Clean", "Private_Dirty"))


class TouchAll:
    """A dataset of one item that reads every name of an index in the worker and reports
    how much of the worker's memory that made private (copy-on-write)."""

    def __init__(self, names: Callable[[int], object], count: int) -> None:
        self.names, self.count = names, count

    def __len__(self) -> int:
        return 1

    def __getitem__(self, _: int) -> int:
        before = private_kb()
        for i in range(self.count):
            self.names(i)
        return private_kb() - before


def copied_per_file(names: Callable[[int], object], count: int) -> float:
    """Bytes per file a forked DataLoader worker copies by reading every name."""
    import torch

    loader = torch.utils.data.DataLoader(TouchAll(names, count), batch_size=None,
                                         num_workers=1, multiprocessing_context="fork")
    return float(next(iter(loader))) * 1024 / count


def file_costs(work: Path, files: int) -> Dict[str, float]:
    """Listing and indexing a split of `files` files, the stored index, its memory in the
    main process and in a forked worker, the sampler's epoch start (= a resume's)."""
    import tracemalloc

    from data.index import DatasetIndex, list_split
    from data.sampler import BatchPlan, GlobalBatchSampler
    from data.volume import Volume

    root = work / f"tree-{files}"
    shutil.rmtree(root, ignore_errors=True)
    make_tree(root, files)
    costs: Dict[str, float] = {}
    began = time.perf_counter()
    index = list_split(Volume(str(root)), "train")
    costs["list+index s"] = time.perf_counter() - began
    stored = work / f"index-{files}.npz"
    index.save(stored)
    shutil.rmtree(root)
    costs["stored B/file"] = stored.stat().st_size / files
    costs["load s"] = timed(lambda: DatasetIndex.load(stored))
    stored.unlink()
    costs["memory B/file"] = sum(a.nbytes for a in (index.names, index.offsets, index.labels,
                                                    index.sizes)) / files
    costs["worker copies B/file"] = copied_per_file(index.name, files)
    as_list = [index.name(i) for i in range(files)]  # what the index's arrays avoid
    costs["list-of-str worker copies B/file"] = copied_per_file(as_list.__getitem__, files)
    del as_list
    plan = BatchPlan(files, 256, world_size=8)
    tracemalloc.start()
    began = time.perf_counter()
    next(iter(GlobalBatchSampler(plan, seed=0, rank=3, start_epoch=2, start_step=7)))
    costs["sampler epoch start s"] = time.perf_counter() - began
    costs["sampler epoch start MB"] = tracemalloc.get_traced_memory()[1] / 1e6
    tracemalloc.stop()
    sampler = iter(GlobalBatchSampler(plan, seed=0, rank=3))
    next(sampler)
    costs["sampler per step s"] = timed(lambda: [next(sampler) for _ in range(100)]) / 100
    return costs


# ---- files through the S3 API: SeaweedFS on loopback ------------------------------------

S3_BUCKET = "scale"


@contextmanager
def seaweedfs(work: Path) -> Iterator[SeaweedFS]:
    """A SeaweedFS server (common/seaweedfs.py) on loopback with an empty bucket `S3_BUCKET`;
    at the end stopped by its pid (SIGTERM, SIGKILL 10 s later) and its data removed."""
    from common.seaweedfs import SeaweedFS

    server = SeaweedFS(work / "seaweedfs")
    try:
        server.start()
        print(f"  SeaweedFS (pid {server.proc.pid}) at {server.endpoint}", flush=True)
        s3_client(server).mkdir(S3_BUCKET)
        yield server
    finally:
        proc, began = server.proc, time.perf_counter()
        server.stop(term_seconds=10)
        if proc is not None:
            print(f"  SeaweedFS stopped in {time.perf_counter() - began:.1f} s "
                  f"(exit {proc.returncode})", flush=True)
        shutil.rmtree(server.root, ignore_errors=True)


def s3_client(server: SeaweedFS) -> s3fs.S3FileSystem:
    """An s3fs filesystem of its own with the admin's key (the one that creates buckets)."""
    import s3fs

    return s3fs.S3FileSystem(skip_instance_cache=True, **server.storage_options(admin=True))


def upload_tree(client: s3fs.S3FileSystem, prefix: str, files: int, chunk: int = 5_000) -> None:
    """`prefix/train/<class>/<file>.JPEG` (`tree_files`), empty objects, put by s3fs's
    `pipe` of a {path: bytes} dict (concurrent PUTs), `chunk` at a time with a progress line."""
    paths = [f"{prefix}/train/{cls}/{name}" for cls, name in tree_files(files)]
    began = time.perf_counter()
    for first in range(0, files, chunk):
        client.pipe({path: b"" for path in paths[first:first + chunk]})
        done = min(first + chunk, files)
        print(f"    uploaded {done:,} / {files:,} objects "
              f"({done / (time.perf_counter() - began):,.0f}/s)", flush=True)


def counted_requests(fs: s3fs.S3FileSystem) -> Counter:
    """The requests s3fs filesystem `fs` makes from now on, by operation (`list_objects_v2`:
    one a page of a listing): each one goes through its `_call_s3`, counted here."""
    calls: Counter = Counter()
    call_s3 = fs._call_s3

    async def counted(method: str, *args: object, **kwargs: object) -> object:
        calls[method] += 1
        return await call_s3(method, *args, **kwargs)

    fs._call_s3 = counted
    return calls


def s3_costs(server: SeaweedFS, work: Path, files: int) -> Dict[str, float]:
    """Listing and indexing `s3://S3_BUCKET/tree-<files>/train` (as `file_costs` a local
    tree: `list_split`, with the trainer's key), its S3 requests, the stored index's load."""
    from data.index import DatasetIndex, list_split
    from data.volume import Volume

    prefix = f"{S3_BUCKET}/tree-{files}"
    upload_tree(s3_client(server), prefix, files)
    volume = Volume(f"s3://{prefix}", storage_options=server.storage_options())
    volume.fs.connect()  # the session (a fixed cost), before the clock
    calls = counted_requests(volume.fs)
    costs: Dict[str, float] = {}
    began = time.perf_counter()
    index = list_split(volume, "train")
    costs["list+index s"] = time.perf_counter() - began
    if len(index) != files or index.url != f"s3://{prefix}/train":
        raise RuntimeError(f"listed {len(index):,} of {files:,} objects at {index.url}")
    costs["LIST requests"] = calls.pop("list_objects_v2", 0)
    if calls:
        print(f"    other requests: {dict(calls)}", flush=True)
    stored = work / f"s3-index-{files}.npz"
    index.save(stored)
    costs["load s"] = timed(lambda: DatasetIndex.load(stored))
    stored.unlink()
    return costs


def prefill(root: Path, entries: int, payload: bytes) -> List[str]:
    """Put `entries` finished objects into a node cache directory as fills leave them (the
    bulk of a big cache, faster than `entries` fills); their keys."""
    import zlib

    from data.cache import FOOTER, MAGIC, cache_key

    blob = payload + FOOTER.pack(MAGIC, len(payload), zlib.crc32(payload))
    keys = [cache_key(f"file:///data/train/{i}.JPEG", len(payload)) for i in range(entries)]
    made = set()
    for key in keys:
        folder = root / "objects" / key[:2]
        if key[:2] not in made:
            folder.mkdir(parents=True, exist_ok=True)
            made.add(key[:2])
        fd = os.open(folder / key, os.O_CREAT | os.O_WRONLY, 0o644)
        os.write(fd, blob)
        os.close(fd)
    return keys


def fill_many(root: str, limit: int, first: int, count: int) -> None:
    """`count` fills into the cache at `root` (one process of the concurrent-ledger run)."""
    from data.cache import NodeCache

    cache = NodeCache.__new__(NodeCache)  # as a DataLoader worker gets it: no recount
    cache.__setstate__({"root": Path(root), "limit_bytes": limit, "_warned": set()})
    for i in range(first, first + count):
        cache.ensure(f"new-{i}", lambda: b"x" * 100)


def start(root: str, limit: int, recount: bool) -> None:
    """One process's start on the cache at `root`; `recount`: preceded by a recount under
    the lock, as every start made before starts recounted only an untrusted ledger."""
    from data.cache import NodeCache

    if recount:
        cache = NodeCache.__new__(NodeCache)
        cache.__setstate__({"root": Path(root), "limit_bytes": limit, "_warned": set()})
        with cache._lock(cache.root / "state.lock"):
            cache._recount("every start recounts")
    NodeCache(Path(root), limit)


def starts(root: Path, limit: int, recount: bool, count: int = 8) -> float:
    """Seconds until `count` processes started at once on the cache have all started."""
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=start, args=(str(root), limit, recount)) for _ in range(count)]

    def all_of_them() -> None:
        for p in procs:
            p.start()
        for p in procs:
            p.join()
            assert p.exitcode == 0

    return timed(all_of_them)


def cache_costs(work: Path, entries: int) -> Dict[str, float]:
    """The node cache holding `entries` files: a lookup (a hit), a fill, an eviction pass,
    a process's start, 8 processes starting at once (as every start recounted, then as
    they do: with the ledger trusted, and after a process died changing it), and fills by
    2 processes at once against 1."""
    from data.cache import CHANGING, NodeCache

    root = work / f"cache-{entries}"
    shutil.rmtree(root, ignore_errors=True)
    payload = b"x" * 100
    keys = prefill(root, entries, payload)
    limit = 1 << 50
    costs: Dict[str, float] = {}
    costs["first start (recount: no ledger yet) s"] = timed(lambda: NodeCache(root, limit))
    costs["a start (ledger trusted) s"] = timed(lambda: NodeCache(root, limit))
    cache = NodeCache.__new__(NodeCache)
    cache.__setstate__({"root": root, "limit_bytes": limit, "_warned": set()})  # a worker's
    rng = random.Random(0)
    sample = [keys[rng.randrange(entries)] for _ in range(1000)]
    costs["lookup s"] = timed(lambda: [cache.get(k, lambda: b"") for k in sample]) / 1000
    costs["fill s"] = timed(lambda: [cache.ensure(f"new-{i}", lambda: payload)
                                     for i in range(500)]) / 500
    cache.limit_bytes = cache.usage_bytes()  # full: the next fill evicts 10%
    began = time.perf_counter()
    candidates = cache._eviction_candidates(1)
    costs["eviction scan (unlocked) s"] = time.perf_counter() - began
    with cache._ledger():
        costs["eviction under the lock s"] = timed(
            lambda: cache._evict(cache._usage() // 10, candidates))
    cache.limit_bytes = limit
    fills = 400
    costs["1 process fills/s"] = 2 * fills / timed(
        lambda: fill_many(str(root), limit, 10_000_000, 2 * fills))
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=fill_many, args=(str(root), limit, 20_000_000 + p * fills,
                                                  fills)) for p in range(2)]

    def both() -> None:
        for p in procs:
            p.start()
        for p in procs:
            p.join()

    costs["2 processes fills/s"] = 2 * fills / timed(both)
    booked = cache.usage_bytes()  # the ledger, as the fills kept it
    on_disk = sum(e.stat().st_size for e in cache._entries())
    costs["ledger error B"] = abs(on_disk - booked)
    # Last: at 100 k entries the recounts take long enough for the prefill's write-back to
    # begin, and an eviction measured after them waited on it (its unlinks 40x slower).
    before = costs["8 starts at once, each recounting (before) s"] = starts(root, limit, True)
    after = costs["8 starts at once, ledger trusted s"] = starts(root, limit, False)
    costs["8 starts: before / trusted x"] = before / after
    with cache._lock(root / "state.lock"):  # as a process killed in a change leaves it
        cache._write_usage(cache._usage(), CHANGING)
    costs["8 starts at once after a kill in a change (1 recounts) s"] = starts(root, limit,
                                                                              False)
    shutil.rmtree(root)
    return costs


# ---- ranks under torchrun: per-step collectives and per-save coordination ----------------

def ranks_worker(out: Path, steps: int, saves: int) -> None:
    """Under torchrun: the loop's per-step collectives (the health check's all-reduce of
    four numbers, the preemption flag's vote) and synchronous saves of a small replicated
    state (DCP's collectives, every rank's marker, rank 0's commit); rank 0 writes medians."""
    import statistics

    import torch
    import torch.distributed as dist

    sys.path.insert(0, str(REPO / "benchmarks"))
    from checkpoint_stall import synchronous_saves
    from train.cluster.world import init_world, shutdown_world
    from common.distributed import any_rank

    world = init_world(torch.device("cpu"))
    health, flags = [], []
    for _ in range(steps):
        summed = torch.tensor([0.5, 0.0, 0.0, 0.0], dtype=torch.float64)
        health.append(timed(lambda: dist.all_reduce(summed)))
        flags.append(timed(lambda: any_rank(False, torch.device("cpu"))))
    torch.manual_seed(0)
    state = {"model": torch.nn.Linear(256, 256).state_dict()}
    save_times = synchronous_saves(out, world, state, saves)
    if world.rank == 0:
        (out / "result.json").write_text(json.dumps({
            "health all-reduce s": statistics.median(health),
            "preemption vote s": statistics.median(flags),
            "save s": statistics.median(save_times)}))
    shutdown_world()


def torchrun_costs(work: Path, ranks: int, steps: int = 200, saves: int = 5
                   ) -> Dict[str, float]:
    out = work / f"torchrun-{ranks}"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone",
         f"--nproc-per-node={ranks}", __file__, "--ranks-worker", str(out), "--steps",
         str(steps), "--saves", str(saves)], capture_output=True, text=True, timeout=600,
        env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"})
    if proc.returncode or not (out / "result.json").is_file():
        raise RuntimeError(f"torchrun with {ranks} rank(s) failed:\n{proc.stderr[-3000:]}")
    result = json.loads((out / "result.json").read_text())
    shutil.rmtree(out)
    return result


# ---- state size --------------------------------------------------------------------------

STATE_MODELS = ("resnet18", "resnet50", "vit_b_16")


def state_costs(work: Path, model: str) -> Dict[str, float]:
    """An async (thread) save's time until committed and the loop's blocked time, against
    torch.save + fsync and one warm copy of the same state (checkpoint_stall's rounds)."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    from checkpoint_stall import measure_stalls

    out = work / f"state-{model}"
    out.mkdir(parents=True, exist_ok=True)
    stalls, mb = measure_stalls(out, 1, model, {"c": ("thread", "dcp")})
    shutil.rmtree(out)
    return {"state MB": mb, "until committed s": stalls["c"]["total"],
            "blocked s": stalls["c"]["blocked"], "torch.save+fsync s": stalls["a'"]["blocked"],
            "warm copy s": stalls["e"]["blocked"],
            "committed / torch.save+fsync": stalls["c"]["total"] / stalls["a'"]["blocked"],
            "blocked / warm copy": stalls["c"]["blocked"] / stalls["e"]["blocked"]}


# ---- the audit ledger --------------------------------------------------------------------

def ledger_bytes_per_line(work: Path, per_rank_batch: int = 32) -> float:
    """Mean size of an audit-ledger line (one rank, one step) at ImageNet's index range."""
    from data.ledger import LedgerWriter

    path = work / "ledger.jsonl"
    rng = random.Random(0)
    with LedgerWriter(path, rank=517, world_size=1024) as ledger:
        for step in range(2000):
            ledger.record(2_000_000 + step, 40, [rng.randrange(1_281_167)
                                                 for _ in range(per_rank_batch)], 2.345678)
    size = path.stat().st_size / 2000
    path.unlink()
    return size


# ---- the whole ---------------------------------------------------------------------------

def measure(group: str, work: Path, opts: argparse.Namespace) -> Dict[str, Curve]:
    curves: Dict[str, Curve] = {}

    def add(name: str, unit: str, cost_unit: str, size: float, value: float,
            fit_from: float = 0.0) -> None:
        curves.setdefault(name, Curve(name, unit, cost_unit, fit_from)).add(size, value)

    if group == "run":
        for days in (0.3, 3.0, 30.0):
            m = Month(days)
            run_dir = work / f"run-{days}"
            wrote = write_events(run_dir, m)
            add("events.jsonl", "days", "MB", days, wrote["bytes"] / 1e6)
            per_line = wrote["bytes"] / wrote["lines"]
            saves = days * DAY / m.interval
            add("events.jsonl, every rank's saves (before)", "days", "MB", days,
                (wrote["bytes"] + saves * 2 * (m.ranks - 1) * per_line) / 1e6)
            add("goodput.json", "days", "MB", days, (run_dir / "goodput.json").stat().st_size / 1e6)
            for name, module, args in (
                    ("report", "train.report", [str(run_dir)]),
                    ("plan --from-run", "checkpointing.plan", ["--from-run", str(run_dir),
                                                               "--mtbf-hours", "34"])):
                seconds, peak = child(module, args)
                add(f"{name} time", "days", "s", days, seconds)
                add(f"{name} peak memory", "days", "MB", days, peak)
            shutil.rmtree(run_dir)
        line = ledger_bytes_per_line(work)
        for days in (0.3, 3.0, 30.0):
            add("audit ledger (1,024 ranks, 32 samples/rank)", "days", "GB", days,
                line * 1024 * days * DAY / 1e9)
    elif group == "ranks":
        for ranks in (64, 512, 4096):
            for name, value in rank0_costs(work, ranks).items():
                add(f"rank 0 {name}", "ranks", "MB" if "MB" in name else "s", ranks, value)
    elif group == "torchrun":
        for ranks in opts.torchrun_ranks:
            for name, value in torchrun_costs(work, ranks).items():
                add(name, "ranks", "s", ranks, value, fit_from=2)  # 1 rank: no collective
    elif group == "files":
        for files in (f for f in (10_000, 100_000, 1_000_000) if f <= opts.max_files):
            for name, value in file_costs(work, files).items():
                add(name, "files", name.split()[-1], files, value)
    elif group == "s3":
        with seaweedfs(work) as server:
            for files in (f for f in (1_000, 10_000, 100_000) if f <= opts.max_files):
                for name, value in s3_costs(server, work, files).items():
                    add(f"S3 {name}", "objects", name.split()[-1], files, value)
    elif group == "cache":
        for files in (f for f in (10_000, 100_000, 1_000_000) if f <= opts.max_files):
            for name, value in cache_costs(work, files).items():
                add(f"cache {name}", "entries", name.split()[-1], files, value)
    elif group == "state":
        for model in STATE_MODELS + (("vit_l_16",) if opts.large else ()):
            costs = state_costs(work, model)
            mb = costs.pop("state MB")
            for name, value in costs.items():
                add(name, "MB of state", "s" if name.endswith(" s") else "x", mb, value)
    return curves


GROUPS = ("run", "ranks", "torchrun", "files", "s3", "cache", "state")
TITLES = {"run": "run length (1,024 ranks, 1 step/s)", "ranks": "rank 0 at a save/resume "
          "(simulated ranks)", "torchrun": "torchrun on CPU (gloo)", "files": "files: listing, "
          "index, sampler", "s3": "files through the S3 API (SeaweedFS on loopback)",
          "cache": "the node cache", "state": "state size (async save vs torch.save, copy)"}


def draw(results: Dict[str, Dict[str, Curve]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    columns = min(3, len(results))
    rows = math.ceil(len(results) / columns)
    fig, axes = plt.subplots(rows, columns, figsize=(7 * columns, 5.5 * rows), squeeze=False)
    for ax in axes.flat[len(results):]:
        ax.set_visible(False)
    for ax, (group, curves) in zip(axes.flat, results.items()):
        for curve in curves.values():
            if min(curve.costs) > 0:
                ax.loglog(curve.sizes, curve.costs, "o-", ms=4,
                          label=f"{curve.name} ({curve.cost_unit}) ~n^{curve.exponent():.2f}")
        ax.set_title(TITLES[group], fontsize=10)
        ax.set_xlabel(next(iter(curves.values())).size_unit if curves else "")
        ax.legend(fontsize=6.5, loc="upper left")
        ax.grid(True, which="major", alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=90)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=",".join(GROUPS),
                        help=f"comma-separated groups of {', '.join(GROUPS)}")
    parser.add_argument("--work", type=Path, help="scratch directory (default: a temporary one)")
    parser.add_argument("--max-files", type=int, default=1_000_000)
    parser.add_argument("--torchrun-ranks", type=lambda s: [int(x) for x in s.split(",")],
                        default=[1, 2, 4])
    parser.add_argument("--large", action="store_true", help="add ViT-L/16 + AdamW (3.7 GB "
                        "of state; about 16 GB of memory at the peak)")
    parser.add_argument("--png", type=Path, default=REPO / "docs" / "scale.png")
    parser.add_argument("--save", type=Path, help="also write the curves to this JSON file")
    parser.add_argument("--load", type=Path, nargs="*", default=[], help="curves saved by "
                        "earlier runs (--save), printed and drawn with these")
    parser.add_argument("--ranks-worker", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=200, help=argparse.SUPPRESS)
    parser.add_argument("--saves", type=int, default=5, help=argparse.SUPPRESS)
    opts = parser.parse_args()
    if opts.ranks_worker:
        ranks_worker(opts.ranks_worker, opts.steps, opts.saves)
        return
    work = Path(tempfile.mkdtemp(prefix="scale-", dir=opts.work))
    results: Dict[str, Dict[str, Curve]] = {}
    for saved in opts.load:
        for group, curves in json.loads(saved.read_text()).items():
            results[group] = {name: Curve(**c) for name, c in curves.items()}
    try:
        for group in [g for g in opts.only.split(",") if g]:
            print(f"{group}:", flush=True)
            results[group] = measure(group, work, opts)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print("\nfitted growth (cost ~ size^b; b = 0 flat, 1 linear):")
    for group, curves in results.items():
        print(f"{TITLES[group]}:")
        for c in curves.values():
            points = ", ".join(f"{s:,.4g}: {v:.4g}" for s, v in zip(c.sizes, c.costs))
            print(f"  b = {c.exponent():5.2f}  {c.name} ({c.cost_unit} per {c.size_unit}: "
                  f"{points})")
    if opts.save:
        opts.save.write_text(json.dumps({g: {n: vars(c) for n, c in curves.items()}
                                         for g, curves in results.items()}, indent=1))
    draw(results, opts.png)
    print(f"picture: {opts.png}")


if __name__ == "__main__":
    main()

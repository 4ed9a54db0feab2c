"""Cost as the work grows: files, ranks, run length, state size; each curve's growth.

    python benchmarks/scale.py                     # every curve, then docs/scale.png
    python benchmarks/scale.py --only run,ranks    # some of them (files, ranks, run,
                                                   #  torchrun, state)

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
import json
import math
import os
import random
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Sequence, Tuple

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

DAY = 86_400


@dataclass
class Curve:
    """One cost measured at several sizes."""

    name: str
    size_unit: str
    cost_unit: str
    sizes: List[float] = field(default_factory=list)
    costs: List[float] = field(default_factory=list)

    def add(self, size: float, cost: float) -> None:
        self.sizes.append(size)
        self.costs.append(cost)
        print(f"  {self.name}: {size:,.0f} {self.size_unit} -> {cost:.4g} {self.cost_unit}",
              flush=True)

    def exponent(self) -> float:
        """b of cost ~ size^b, least squares over the log-log points."""
        xs = [math.log(s) for s in self.sizes]
        ys = [math.log(max(c, 1e-12)) for c in self.costs]
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


def child(argv: Sequence[str]) -> Tuple[float, float, int]:
    """(seconds, peak resident MB, exit code) of a command run in a process of its own."""
    began = time.perf_counter()
    proc = subprocess.Popen(list(argv), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - began
    proc.returncode = os.waitstatus_to_exitcode(status)
    err = proc.stderr.read().decode(errors="replace")
    proc.stderr.close()
    if proc.returncode != 0:
        print(f"    {' '.join(argv[:4])} failed ({proc.returncode}): {err[-500:]}")
    return seconds, usage.ru_maxrss / 1024, proc.returncode


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
                                                       MetadataIndex, TensorProperties,
                                                       TensorStorageMetadata)

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
    metadata = pickle.dumps(Metadata(tensors, storage_data=storage))
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
        manager._wait_for_markers(partial, steps[-1])
        manager._rename_into_place(store, partial, steps[-1])
        manager._trust_what_was_written(steps[-1])

    costs["commit"] = timed(commit_it)
    costs["retention"] = timed(lambda: manager.apply_retention(steps[-1]))
    fresh = CheckpointManager(CheckpointOptions(dir=str(root), keep_last=keep), rank=0,
                              world_size=ranks)
    costs["retention, fresh process"] = timed(lambda: fresh.apply_retention(steps[-1]))
    costs["verify"] = timed(lambda: scrub(store))
    costs["resume discovery"] = timed(lambda: next(commit.find_complete(store)))
    costs["metadata MB"] = (root / commit.step_dir_name(steps[-1]) / ".metadata").stat().st_size / 1e6
    shutil.rmtree(root)
    return costs

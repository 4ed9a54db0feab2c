"""Reading the audit ledger (`audit.ledger=`): the surviving history of a run, its samples,
and the proof that a restart resumed from a checkpoint instead of starting over."""

from __future__ import annotations

import threading
import time
from collections import Counter
from pathlib import Path
from typing import Dict, List, Mapping, Set

from checkpointing import commit
from checkpointing.storage import Store
from common.jsonl import records
from data.ledger import MAX_LEDGER_LINE
from support.launch import worker_pids
from support.runs import EPOCHS, NUM_TRAIN, STEPS_PER_EPOCH


def ledger_records(ledger: Path) -> List[dict]:
    """Every complete line, in file order."""
    return list(records(ledger, MAX_LEDGER_LINE)) if ledger.exists() else []


def steps_done(ledger: Path, since: float = 0.0) -> int:
    """How many distinct steps were recorded after time `since`."""
    return len({r["step"] for r in ledger_records(ledger) if r["time"] > since})


def recorded_steps(ledger: Path) -> Counter:
    """How often each (step, rank) was recorded: 2 means the step was done again."""
    return Counter((r["step"], r["rank"]) for r in ledger_records(ledger))


def surviving_history(ledger: Path) -> Dict[int, List[dict]]:
    """{step: the records of the attempt that recorded it last, one per rank}: a step done
    again after a crash (maybe at another world size) replaces the earlier records."""
    last: Dict[int, Dict[int, dict]] = {}
    for record in ledger_records(ledger):
        step, rank, world = record["step"], record["rank"], record["world"]
        ranks = last.setdefault(step, {})
        if any(r["world"] != world for r in ranks.values()):
            ranks.clear()  # the step was redone at another world size
        ranks[rank] = record
    return {step: [ranks[r] for r in sorted(ranks)] for step, ranks in sorted(last.items())}


def samples_per_step(ledger: Path) -> Dict[int, List[int]]:
    """{step: the global batch's samples, over all ranks, sorted}: the same whatever the
    world size."""
    return {step: sorted(i for r in records for i in r["samples"])
            for step, records in surviving_history(ledger).items()}


def samples_per_rank(ledger: Path) -> Dict[int, List[List[int]]]:
    """{step: each rank's samples, in the order it trained them}: for runs at one world
    size, where the order is part of what must be reproduced."""
    return {step: [r["samples"] for r in records]
            for step, records in surviving_history(ledger).items()}


def assert_exactly_once(ledger: Path, epochs: int = EPOCHS,
                        steps_per_epoch: int = STEPS_PER_EPOCH) -> None:
    """Every sample of every epoch exactly once in the surviving history, with every rank of
    each step present."""
    history = surviving_history(ledger)
    assert sorted(history) == list(range(1, steps_per_epoch * epochs + 1)), sorted(history)
    for step, records in history.items():
        assert [r["rank"] for r in records] == list(range(records[0]["world"])), step
    for epoch in range(epochs):
        seen = [i for s in range(epoch * steps_per_epoch + 1, (epoch + 1) * steps_per_epoch + 1)
                for r in history[s] for i in r["samples"]]
        assert len(seen) == len(set(seen)) == NUM_TRAIN, f"epoch {epoch}"


def first_step_after(ledger: Path, t: float) -> float:
    """When the first step after time `t` was recorded: restart-to-first-step."""
    return min(r["time"] for r in ledger_records(ledger) if r["time"] > t) - t


def assert_resumed(ledger: Path, since: float, committed: Mapping[int, float]) -> int:
    """The first attempt that recorded steps after time `since` (a kill, a stop) resumed
    from the newest checkpoint instead of starting over: on every rank of its world its
    first step is the same step S > 1, and S - 1 is the newest checkpoint in `committed`
    ({step: when it was seen complete}) seen before that attempt's first step, so no step
    up to it was done again. A silent restart from scratch, or from an older checkpoint,
    fails here; "ends bit-identical to the reference" cannot tell. Returns S - 1."""
    first: Dict[int, dict] = {}
    for record in ledger_records(ledger):
        if record["time"] > since:
            first.setdefault(record["rank"], record)
    assert first, f"no step was recorded after {since}"
    world = next(iter(first.values()))["world"]
    assert sorted(first) == list(range(world)), f"ranks that stepped: {sorted(first)}"
    steps = {rank: r["step"] for rank, r in first.items()}
    assert len(set(steps.values())) == 1, f"the ranks resumed at different steps: {steps}"
    start = steps[0]
    began = min(r["time"] for r in first.values())
    before = sorted(s for s, seen in committed.items() if seen < began)
    assert before and start > 1, f"the restart began at step {start} (checkpoints: {before})"
    assert start - 1 == before[-1], (
        f"the restart began at step {start}, not one past the newest checkpoint {before}")
    return start - 1


class RestartWatch:
    """Watches a torchrun job that restarts by itself (`--max-restarts`, run `r` under
    `run_root`): `seen` is when each checkpoint was first seen committed (a commit renames
    the step directory into place), `ended` when each group of trainer processes was all
    gone. A dying group's last steps are recorded before it is gone, and a new group steps
    seconds after it starts, so `ended` splits the ledger between attempts."""

    def __init__(self, run_root: Path, every: float = 0.1) -> None:
        self.run_root, self.every = run_root, every
        self.store = Store(str(run_root / "r" / "checkpoints"))
        self.seen: Dict[int, float] = {}
        self.ended: List[float] = []
        self._group: Set[int] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        while not self._stop.is_set():
            try:
                steps = commit.committed_steps(self.store)
            except OSError:  # no checkpoint directory yet
                steps = []
            live = set(worker_pids(self.run_root).values())
            now = time.time()
            for step in steps:
                self.seen.setdefault(step, now)
            if self._group and not self._group & live:
                self.ended.append(now)
                self._group = live
            else:  # torchrun starts a group only once the last one is gone
                self._group |= live
            self._stop.wait(self.every)

    def __enter__(self) -> "RestartWatch":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def assert_every_restart_resumed(self, ledger: Path) -> List[int]:
        """`assert_resumed` for each group that ended before another one stepped; returns
        the checkpoint each restart resumed from."""
        last = max((r["time"] for r in ledger_records(ledger)), default=0.0)
        return [assert_resumed(ledger, end, self.seen) for end in self.ended if end < last]

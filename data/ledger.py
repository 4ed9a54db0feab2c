"""The audit ledger (`audit.ledger=PATH`): which samples each rank trained on, step by step.

One file for all ranks. Each line is one optimizer step of one rank,

    {"step": 12, "rank": 0, "epoch": 1, "samples": [dataset indices], "loss": "0x1.8p-1",
     "world": 2, "time": 1764489600.123}

(`world`: the world size that trained it; `time`: when, in seconds since the epoch; a step
a health rollback skipped has `"loss": null, "skipped": true`), appended whole
(common/jsonl.py), so lines from concurrent ranks never interleave. A crash can leave the
last line torn; `read_ledger` ignores it. A resumed run recomputes the
steps after its checkpoint and appends them again; the last record of a (step, rank) is the
surviving history (after a world-size change, the records of the last world size that
recorded the step).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Dict, Iterable, Optional, Tuple

import torch.distributed as dist

from common.jsonl import Appender, records

# A rank's line lists its share of a global batch: 4 MB holds ~400,000 sample indices.
MAX_LEDGER_LINE = 1 << 22


class LedgerWriter:
    def __init__(self, path: Path, rank: int, world_size: int = 1) -> None:
        self.rank, self.world_size = rank, world_size
        self._file = Appender(path)

    def record(self, step: int, epoch: int, samples: Iterable[int], loss: Optional[float],
               rank: Optional[int] = None, world_size: Optional[int] = None) -> None:
        """One line; `loss` None marks a step whose global batch was skipped. `rank` and
        `world_size` override the writer's for a step whose width was chosen step by step
        (strategy=ddp_ft: this trainer's place among the step's participants)."""
        entry = {"step": step, "rank": self.rank if rank is None else rank, "epoch": epoch,
                 "samples": [int(i) for i in samples],
                 "loss": None if loss is None else float(loss).hex(),
                 "world": self.world_size if world_size is None else world_size,
                 "time": round(time.time(), 3)}
        if loss is None:
            entry["skipped"] = True
        self._file.append(entry)

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> "LedgerWriter":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_ledger(path: Optional[str], rank: Optional[int] = None) -> Optional[LedgerWriter]:
    """A writer for `path` (None: no ledger); the rank defaults to torch.distributed's."""
    if not path:
        return None
    distributed = dist.is_available() and dist.is_initialized()
    if rank is None:
        rank = dist.get_rank() if distributed else 0
    return LedgerWriter(Path(path), rank, dist.get_world_size() if distributed else 1)


def read_ledger(path: Path) -> Dict[Tuple[int, int], dict]:
    """{(step, rank): record}, the last record of each. A torn last line is ignored, and so
    is a torn line a resumed run has since ended with a newline, and a line longer than
    MAX_LEDGER_LINE (skipped unread)."""
    last: Dict[Tuple[int, int], dict] = {}
    for record in records(path, MAX_LEDGER_LINE):
        try:
            last[(int(record["step"]), int(record["rank"]))] = record
        except (ValueError, KeyError, TypeError, OverflowError):
            continue
    return last

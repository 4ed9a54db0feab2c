"""Checkpoints in tests: reading one whole, comparing runs bit for bit, what a restart may
resume from, damaging a file."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Dict, Optional

import torch
from torch.distributed.checkpoint.format_utils import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

from checkpointing import commit
from checkpointing.safe_load import SafeFileSystemReader
from checkpointing.storage import Store
from support.ledger import assert_exactly_once, samples_per_rank
from support.runs import FINAL


def checkpoint_contents(path: Path) -> Dict[str, object]:
    """Every item of a checkpoint, flattened to dotted keys."""
    state: Dict[str, object] = {}
    _load_state_dict(state, storage_reader=SafeFileSystemReader(str(path)),
                     planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    flat = flattened(state)
    assert any(k.startswith("model.") for k in flat)
    return flat


def flattened(state: Dict[str, object]) -> Dict[str, object]:
    """A nested state dict's leaves under dotted keys, as DCP names its items."""
    flat: Dict[str, object] = {}

    def walk(prefix: str, node: object) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                walk(f"{prefix}{k}.", v)
        else:
            flat[prefix[:-1]] = node

    walk("", state)
    return flat


def assert_same_contents(a: Dict[str, object], b: Dict[str, object],
                         keys_prefix: str = "") -> None:
    keys = sorted(k for k in a if k.startswith(keys_prefix))
    assert keys == sorted(k for k in b if k.startswith(keys_prefix))
    differ = [k for k in keys if not (torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor)
                                      else a[k] == b[k])]
    assert not differ, differ[:10]


def reference_of(run_root: Path) -> dict:
    """What a finished run `r` under `run_root` is compared by: its final checkpoint,
    flattened, and each step's samples per rank."""
    return {"contents": checkpoint_contents(run_root / "r" / "checkpoints" / FINAL),
            "samples": samples_per_rank(run_root / "ledger.jsonl")}


def assert_matches_reference(run_root: Path, reference: dict) -> None:
    """The run `r` under `run_root` ended bit-identical to the `reference` run (same world
    size): the same final checkpoint, the same samples in the same order on every rank, and
    every sample once per epoch in its surviving history."""
    ours = reference_of(run_root)
    assert_same_contents(ours["contents"], reference["contents"])
    assert ours["samples"] == reference["samples"]
    assert_exactly_once(run_root / "ledger.jsonl")


def complete_now(store: Store) -> Dict[int, float]:
    """{step: now} for each complete checkpoint in `store`: what a restart may resume from
    (for `assert_resumed`), read once its predecessor is dead."""
    now = time.time()
    return {step: now for step, _ in commit.find_complete(store)}


def flip_byte(path: Path, offset: Optional[int] = None) -> None:
    """Damage `path` silently: one bit flipped, at `offset` or the middle, size unchanged."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2 if offset is None else offset] ^= 0x01
    path.write_bytes(bytes(data))

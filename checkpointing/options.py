"""The checkpoint options' rules, written once and torch-free: the trainer's config schema
(`checkpoint.*`, checked before any work) and `CheckpointOptions` (for callers of the
library) both take them from here."""

from __future__ import annotations

from enum import Enum


class AsyncMode(str, Enum):
    off = "off"  # synchronous dcp.save
    thread = "thread"  # dcp.async_save in a background thread
    process = "process"  # dcp.async_save in a background process


class CheckpointFormat(str, Enum):
    dcp = "dcp"  # DCP's standard format: stock torch.distributed.checkpoint reads it
    raw = "raw"  # tensors as bare bytes: less CPU per save, but only this trainer reads it


# Keep at least two, so that a checkpoint damaged after its commit still has a fallback.
MIN_KEEP_LAST = 2

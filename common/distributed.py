"""Collectives on Python objects, and ranks agreeing on a flag."""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist


def broadcast_object(obj: Any, group: Optional[dist.ProcessGroup] = None) -> Any:
    """Rank 0's `obj` on every rank of `group` (default: the whole world; a group must
    hold global rank 0); `obj` itself when there is no process group or it has one rank.
    A collective: every rank of the group must call it."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


def _reduce(value: int, op: Any, device: Optional[torch.device],
            group: Optional[dist.ProcessGroup]) -> int:
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return value
    box = torch.tensor([value], dtype=torch.int64, device=device)  # NCCL: on the GPU
    dist.all_reduce(box, op=op, group=group)
    return int(box.item())


def smallest(value: int, device: Optional[torch.device] = None,
             group: Optional[dist.ProcessGroup] = None) -> int:
    """The smallest `value` over the ranks of `group` (default: the world), on every rank.
    A collective: every rank of the group must call it."""
    return _reduce(value, dist.ReduceOp.MIN, device, group)


def any_rank(flag: bool, device: Optional[torch.device] = None,
             group: Optional[dist.ProcessGroup] = None) -> bool:
    """True on every rank of `group` (default: the world) when `flag` is set on any of
    them. A collective: every rank of the group must call it."""
    return bool(_reduce(int(flag), dist.ReduceOp.MAX, device, group))


def every_rank(flag: bool, device: Optional[torch.device] = None,
               group: Optional[dist.ProcessGroup] = None) -> bool:
    """True on every rank of `group` (default: the world) when `flag` is set on all of
    them. A collective: every rank of the group must call it."""
    return bool(_reduce(int(flag), dist.ReduceOp.MIN, device, group))

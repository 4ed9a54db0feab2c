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


def _vote(flag: bool, op: Any, device: Optional[torch.device],
          group: Optional[dist.ProcessGroup]) -> bool:
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return flag
    vote = torch.tensor([int(flag)], dtype=torch.int32, device=device)  # NCCL: on the GPU
    dist.all_reduce(vote, op=op, group=group)
    return bool(vote.item())


def any_rank(flag: bool, device: Optional[torch.device] = None,
             group: Optional[dist.ProcessGroup] = None) -> bool:
    """True on every rank of `group` (default: the world) when `flag` is set on any of
    them. A collective: every rank of the group must call it."""
    return _vote(flag, dist.ReduceOp.MAX, device, group)


def every_rank(flag: bool, device: Optional[torch.device] = None,
               group: Optional[dist.ProcessGroup] = None) -> bool:
    """True on every rank of `group` (default: the world) when `flag` is set on all of
    them. A collective: every rank of the group must call it."""
    return _vote(flag, dist.ReduceOp.MIN, device, group)

"""Collectives on Python objects."""

from __future__ import annotations

from typing import Any, Optional

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

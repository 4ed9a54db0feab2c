"""Process groups: from torchrun's environment, else a 1-rank gloo group.

Even a single process gets a group, so the checkpoint path is the same code at any scale
(and DCP's process-based async save has one to use). Checkpointing gets its own gloo group:
DCP's background collectives must never interleave with training's (DESIGN.md pitfalls).
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist


@dataclass(frozen=True)
class World:
    rank: int
    world_size: int
    local_rank: int
    checkpoint_group: dist.ProcessGroup


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_world(timeout_s: float = 300.0) -> World:
    """Join (or create) the default group; never with the 30-minute default timeout."""
    timeout = timedelta(seconds=timeout_s)
    if dist.is_initialized():
        pass
    elif "WORLD_SIZE" in os.environ:  # launched by torchrun
        dist.init_process_group(backend="gloo", timeout=timeout)
    else:
        # A fresh port per run; DCP's process-based saver finds the store through the env.
        port = _free_port()
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        store = dist.TCPStore("127.0.0.1", port, 1, is_master=True, timeout=timeout)
        dist.init_process_group(backend="gloo", store=store, rank=0, world_size=1,
                                timeout=timeout)
    group = dist.new_group(backend="gloo", timeout=timeout)
    return World(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", 0)),
                 group)


def broadcast_object(obj: Any, world: World) -> Any:
    """Rank 0's `obj` on every rank."""
    if world.world_size == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=world.checkpoint_group)
    return box[0]


def shutdown_world() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()

"""Process groups: from torchrun's environment (or SLURM's, read as torchrun's: `srun python
-m train`, train/cluster/slurm.py), else a 1-rank gloo group.

Even a single process gets a group, so the checkpoint path is the same code at any scale
(and DCP's process-based async save has one to use). Everything but training's own
collectives runs on a second gloo group, `World.control_group`: DCP's background
collectives must never interleave with training's (docs/architecture.md, pitfalls).
"""

from __future__ import annotations

import logging
import os
import socket
import time
import uuid
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from train.cluster.slurm import torchrun_environment

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class World:
    rank: int
    world_size: int
    local_rank: int
    # A gloo group of its own for all but training's collectives: checkpoint saves (DCP's
    # background collectives must never interleave with DDP's), the run lock, broadcasts of
    # run ids and verdicts, the pre-flight. gloo also on GPUs: it carries host objects.
    control_group: dist.ProcessGroup
    node_rank: int = 0  # torchrun's GROUP_RANK: which agent (node) this rank runs under


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launched_by_torchrun() -> bool:
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ


def init_world(device: torch.device, timeout_s: float = 300.0,
               init_timeout_s: float = 600.0) -> World:
    """Join (or create) the default group: nccl on CUDA, else gloo; and the control group,
    always gloo.

    `init_timeout_s` bounds joining (peers may still be importing torch, or be restarting);
    `timeout_s` then bounds every collective, so a dead or frozen peer fails the group
    within it instead of after torch's 30-minute default.
    """
    timeout, init_timeout = timedelta(seconds=timeout_s), timedelta(seconds=init_timeout_s)
    os.environ.update(torchrun_environment(os.environ))  # a task of srun: its rank, its master
    backend = "nccl" if device.type == "cuda" else "gloo"
    if dist.is_initialized():
        pass
    elif launched_by_torchrun():
        rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        if device.type == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        store = round_store(rank, world_size, init_timeout)
        dist.init_process_group(backend=backend, store=store, rank=rank,
                                world_size=world_size, timeout=init_timeout)
    else:
        # A fresh port per run; DCP's process-based saver finds the store through the env.
        port = _free_port()
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        store = dist.TCPStore("127.0.0.1", port, 1, is_master=True, timeout=init_timeout)
        dist.init_process_group(backend=backend, store=store, rank=0, world_size=1,
                                timeout=init_timeout)
    group = dist.new_group(backend="gloo", timeout=init_timeout)
    dist.barrier(group=group)  # every rank has joined both groups: now the short timeout
    dist.set_timeout(timeout)
    dist.set_timeout(timeout, group)
    return World(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", 0)),
                 group, node_rank=int(os.environ.get("GROUP_RANK", 0)))


def round_store(rank: int, world_size: int, timeout: timedelta) -> dist.Store:
    """The key space of this rendezvous round in torchrun's store.

    torchrun's agents keep one store for the whole job, and the ranks of a restarted round
    would read the addresses a dead round left there (docs/architecture.md, pitfalls: "Connection
    refused, remote=<old port>"). `TORCHELASTIC_RESTART_COUNT` cannot name the round: it is
    per agent, and a node that joins an elastic job starts at 0. So rank 0 of the round makes
    up a fresh key and hands it to every other rank by a handshake that no leftover of an
    earlier round can satisfy (`agree_round_key`).
    """
    addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    agent_hosts_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(addr, port, world_size, is_master=rank == 0 and not agent_hosts_store,
                          timeout=timeout)
    key = agree_round_key(store, rank, world_size, timeout.total_seconds())
    log.debug("rendezvous round key %s", key)
    return dist.PrefixStore(f"goodput/round/{key}", store)


def agree_round_key(store: dist.Store, rank: int, world_size: int, timeout_s: float) -> str:
    """Rank 0's fresh key on every rank.

    Each other rank posts a nonce of its own under `hello/<rank>` and waits for rank 0's
    answer under `ack/<nonce>`: a nonce is new, so the answer cannot be a dead round's.
    Rank 0 may first see a dead round's nonce in `hello/<rank>`: it answers it only if no
    one has (`compare_set`), and it counts a rank as served only once that rank confirms
    under `got/<nonce>`; meanwhile a new nonce in `hello/<rank>` replaces the old one.
    """
    deadline = time.monotonic() + timeout_s
    if rank != 0:
        nonce = uuid.uuid4().hex
        store.set(f"goodput/hello/{rank}", nonce)
        store.wait([f"goodput/ack/{nonce}"], timedelta(seconds=timeout_s))
        key = store.get(f"goodput/ack/{nonce}").decode()
        store.set(f"goodput/got/{nonce}", "1")
        return key
    key = uuid.uuid4().hex[:16]
    for peer in range(1, world_size):
        served = None
        while True:
            store.wait([f"goodput/hello/{peer}"], timedelta(seconds=timeout_s))
            nonce = store.get(f"goodput/hello/{peer}").decode()
            if nonce != served and store.compare_set(f"goodput/ack/{nonce}", "",
                                                     key).decode() == key:
                served = nonce
            if served == nonce and store.check([f"goodput/got/{nonce}"]):
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank {peer} did not join the rendezvous round within "
                                   f"{timeout_s:.0f}s (strategy.init_timeout_seconds)")
            time.sleep(0.02)
    return key


def shutdown_world() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()

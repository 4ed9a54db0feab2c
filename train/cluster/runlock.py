"""One trainer per run: `<run dir>/run.lock`, held by every rank for the whole run.

Two trainers in one run directory would both resume from the same checkpoint and then
overwrite each other's checkpoints, ledger lines and MLflow run. That happens easily: killing
a torchrun agent leaves its workers running (each lives in a session of its own), and a
relaunch of the same command would start a second set beside them.

The lock is a POSIX record lock (`fcntl.lockf`), which suits every case here:
- the kernel drops it when its process dies, however it dies, so a stale lock (its holders
  gone) is simply free, and the next trainer takes it over (saying so in one line);
- it is owned by the process, not inherited by forked DataLoader workers, so a killed
  rank's lock is free at once even while its workers wind down, and the restart that
  torchrun starts right after stopping a round finds it free;
- it works across machines on NFS, when `run.root` is shared storage.

Rank 0 takes it exclusively (never waiting: a second trainer is refused at once, with the
holder's host, pid, start time and launch id, which rank 0 writes into the file), then
turns it into a shared lock that every other rank takes too. So the run stays locked as
long as *any* of its ranks lives: if the holder's rank 0 dies while other ranks live on
(their torchrun agent gone too), a relaunch is refused until they are gone, rather than
running beside ranks that may still append to the ledger or write checkpoint shards.
(Such orphans rarely live long: their next collective fails once rank 0 is gone.)
Every rank learns rank 0's verdict, so all of them exit with the same error.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import socket
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import Iterator, List, Optional

import torch.distributed as dist

from common.distributed import broadcast_object
from common.processes import pid_alive
from train.cluster.world import World
from train.errors import ConfigError
from train.cluster.rank_dirs import mark_latest_record

log = logging.getLogger(__name__)

LOCK_FILE = "run.lock"


class RunLocked(ConfigError):
    """Another trainer holds this run (exit code 2: stop it, or wait for it)."""


def _workers(world: World) -> List[str]:
    """`host:pid` of every rank, in rank order."""
    me = f"{socket.gethostname()}:{os.getpid()}"
    if world.world_size == 1:
        return [me]
    everyone: List[Optional[str]] = [None] * world.world_size
    dist.all_gather_object(everyone, me, group=world.control_group)
    return [str(w) for w in everyone]


def describe_holder(text: str) -> str:
    """The holder the lock file names, in words."""
    try:
        holder = json.loads(text)
        host, pid, since = holder["host"], int(holder["pid"]), holder["since"]
        job, restart, workers = holder["job"], holder["restart"], list(holder["workers"])
    except (ValueError, KeyError, TypeError):
        return "a trainer that is starting or ending (the lock file names no holder yet)"
    if job is None:
        return f"pid {pid} on {host} (a single process, since {since})"
    here = socket.gethostname()
    alive = [w for w in workers
             if w.split(":")[0] == here and pid_alive(int(w.rsplit(":", 1)[1]))]
    return (f"pid {pid} on {host} (rank 0 of torchrun job {job}, restart {restart}, since "
            f"{since}; ranks {', '.join(workers)}; alive on this host: "
            f"{', '.join(alive) or 'none'})")


def _take(fd: int, path: Path, run_name: str, workers: List[str]) -> Optional[str]:
    """Rank 0: lock `fd` exclusively and write the holder into it, then share the lock with
    the other ranks. None on success, else why not."""
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as err:
        if err.errno not in (errno.EACCES, errno.EAGAIN):
            raise
        text = os.pread(fd, 1 << 16, 0).decode(errors="replace")
        return (f"run {run_name} is in use by another trainer: {path} is held by "
                f"{describe_holder(text)}. Stop it (the workers of a killed torchrun agent "
                f"keep running), or wait for it to end; once all its processes are gone, a "
                f"relaunch takes the lock over")
    previous = os.pread(fd, 1 << 16, 0).decode(errors="replace")
    if previous:  # its holder never released it: it died (or was restarted by torchrun)
        log.warning("run lock %s: taking over from %s, which is gone", path,
                    describe_holder(previous))
    holder = {"host": socket.gethostname(), "pid": os.getpid(),
              "since": datetime.now().astimezone().isoformat(timespec="seconds"),
              "job": os.environ.get("TORCHELASTIC_RUN_ID"),
              "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
              "workers": workers}
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(holder).encode(), 0)
    os.fsync(fd)
    fcntl.lockf(fd, fcntl.LOCK_SH)  # atomically: no other trainer can slip in between
    return None


@contextmanager
def hold_run_lock(run_dir: Path, run_name: str, world: World) -> Iterator[None]:
    """Hold the run's lock on every rank until the block ends; raise `RunLocked` on every
    rank when another trainer holds it. A collective: every rank must call it."""
    workers = _workers(world)
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / LOCK_FILE
    # Never close another descriptor of this file in this process: closing any of them
    # drops the process's POSIX locks on it.
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    held = False
    try:
        refusal = _take(fd, path, run_name, workers) if world.rank == 0 else None
        refusal = broadcast_object(refusal, world.control_group)
        if refusal:
            raise RunLocked(refusal)
        if world.rank != 0:
            fcntl.lockf(fd, fcntl.LOCK_SH)  # rank 0 holds it shared already: no wait
        held = True
        if world.rank == 0:
            mark_latest_record()
        yield
    finally:
        if held and world.rank == 0:
            os.ftruncate(fd, 0)  # released, not lost: the next trainer finds it clean
        os.close(fd)

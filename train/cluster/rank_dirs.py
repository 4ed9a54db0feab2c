"""Hydra under torchrun: one run, one run directory, one set of Hydra files.

Every rank of a torchrun job runs `python -m train` with the same arguments, so every rank
composes the same config, the same `run.name` and so the same run directory, on every
restart too. What must differ per rank is in `conf/config.yaml`'s `hydra:` block, through
the resolvers below, so that no override (and no difference in `run.name`) is needed: only
rank 0 writes Hydra's `.hydra/` files (the others would race it for the same files), and
each rank logs to a file of its own (`train.log` on rank 0, as in a single-process run;
`train_rank<R>.log` on rank R).

This module reads torchrun's environment only (no torch import): `python -m train --help`
and config mistakes stay fast.
"""

from __future__ import annotations

import copy
import logging
import os
import sys
from contextlib import suppress
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Optional

from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from train.errors import EXIT_CONFIG, ConfigError
from train.cluster.slurm import torchrun_environment

log = logging.getLogger(__name__)


def _launcher_value(name: str, default: int) -> int:
    """torchrun's variable `name` (RANK, WORLD_SIZE), else srun's task's (train/cluster/slurm.py),
    else `default` (a single process)."""
    try:
        return int(os.environ.get(name) or torchrun_environment(os.environ).get(name, default))
    except (ConfigError, ValueError):  # said in one line when the process group starts
        return default


def _rank() -> int:
    return _launcher_value("RANK", 0)


# This process's launch: when it started, and its pid (unique on this host at that time).
LAUNCH_ID = f"{datetime.now():%Y-%m-%d_%H-%M-%S}-{os.getpid()}"
LATEST_RECORD = "latest"


def replica_dir_name(replica_id: int) -> str:
    """strategy=ddp_ft: the directory of a replica group inside the run's (and inside its
    checkpoint and staging dirs): its log files, Hydra record, lock, timeline."""
    return f"replica_{replica_id}"


def _replica_subdir(strategy: object, replica_id: int) -> str:
    """'/replica_<id>' under strategy=ddp_ft (every group is its own job, with a log and a
    Hydra record of its own), else ''."""
    return f"/{replica_dir_name(replica_id)}" if getattr(strategy, "value",
                                                          strategy) == "ddp_ft" else ""


def register_resolvers() -> None:
    """`${goodput.on_rank_zero:VALUE}` (VALUE on rank 0, else null),
    `${goodput.rank_suffix:}` ('' on rank 0, else `_rank<R>`), `${goodput.launch_id:}`
    (`LAUNCH_ID`) and `${goodput.replica_subdir:STRATEGY,REPLICA_ID}`; safe to call more
    than once."""
    resolvers = {"goodput.on_rank_zero": lambda value: None if _rank() else value,
                 "goodput.rank_suffix": lambda: f"_rank{_rank()}" if _rank() else "",
                 "goodput.launch_id": lambda: LAUNCH_ID,
                 "goodput.replica_subdir": _replica_subdir}
    for name, resolver in resolvers.items():
        if not OmegaConf.has_resolver(name):
            OmegaConf.register_new_resolver(name, resolver)


def refuse_multirun_under_torchrun() -> None:
    """A sweep under torchrun (or srun) would run every job on every rank, each rank sweeping
    on its own: end at once, with one line pointing to a sweep from a single process. A job
    that Hydra's submitit launcher started is one job of a sweep, its tasks the ranks of it."""
    world_size = _launcher_value("WORLD_SIZE", 1)
    if (world_size > 1 and HydraConfig.get().mode == RunMode.MULTIRUN
            and "SUBMITIT_EXECUTOR" not in os.environ):
        print(f"error: a multirun sweep (-m, or hydra.mode=MULTIRUN) cannot run under torchrun "
              f"(WORLD_SIZE={world_size}): every rank would run every job. Sweep from a single "
              f"process instead (python -m train -m ..., or with a Hydra launcher plugin such "
              f"as submitit), or start one torchrun per job with that job's overrides",
              file=sys.stderr)
        raise SystemExit(EXIT_CONFIG)


def mark_latest_record() -> None:
    """Link `<run dir>/.hydra/latest` to this launch's Hydra record. Call it holding the run
    lock: a launch that is refused must leave the link at the run that is training."""
    try:
        hydra_cfg = HydraConfig.get()
    except ValueError:  # composed outside @hydra.main (tests, notebooks): no record
        return
    subdir = hydra_cfg.output_subdir
    if subdir is None or Path(subdir).parent == Path("."):  # not rank 0, or a flat layout
        return
    record = Path(hydra_cfg.runtime.output_dir) / subdir
    if not record.is_dir():
        return
    link = record.parent / LATEST_RECORD
    temporary = record.parent / f".{LATEST_RECORD}-{os.getpid()}"
    try:
        with suppress(FileNotFoundError):
            temporary.unlink()
        temporary.symlink_to(record.name)
        temporary.replace(link)  # atomic: a reader sees the old record or the new one
    except OSError as err:  # e.g. a volume without symlinks: the records themselves remain
        log.warning("could not link %s to this launch's Hydra record %s: %s", link,
                    record.name, err)


@dataclass(frozen=True)
class RunPaths:
    """Where this process keeps a run's files, decided once at start (`run_paths`); the
    config stays as composed, so `checkpoint.dir` always means what was typed. The run
    directory holds its lock, timeline, goodput and health files; the checkpoint directory
    is a mounted path or an fsspec URL; the staging tier and node cache may be None (none)."""

    run_dir: Path
    checkpoint_dir: str
    staging_dir: Optional[str]
    cache_dir: Optional[str]

    def applied_to(self, cfg: DictConfig) -> DictConfig:
        """A copy of `cfg` holding these paths: the config as this process uses it, which
        MLflow records."""
        used = copy.deepcopy(cfg)
        used.checkpoint.dir, used.checkpoint.staging_dir = self.checkpoint_dir, self.staging_dir
        used.data.cache_dir = self.cache_dir
        return used


def run_paths(cfg: DictConfig, replica_id: Optional[int], node_rank: Optional[int]) -> RunPaths:
    """This process's paths under `cfg` (resolved).

    `replica_id`: strategy=ddp_ft's replica group (None: no groups), which is its own job
    with its own `replica_<id>/` of the run directory, of `checkpoint.dir` and of
    `checkpoint.staging_dir`: no group's retention can take another's save in flight for a
    dead trainer's leftovers. `node_rank`: torchrun's GROUP_RANK (None outside torchrun),
    whose agent gets its own `node_<node_rank>/` of `checkpoint.staging_dir` and
    `data.cache_dir`: two agents on one machine are two nodes, and must not share a staging
    tier or a cache that each believes is its own.
    """
    run_dir, checkpoint_dir = Path(cfg.run.root) / cfg.run.name, str(cfg.checkpoint.dir)
    staging, cache = cfg.checkpoint.staging_dir, cfg.data.cache_dir
    if replica_id is not None:
        replica = replica_dir_name(replica_id)
        run_dir = run_dir / replica
        checkpoint_dir = f"{checkpoint_dir.rstrip('/')}/{replica}"
        if staging:
            staging = str(Path(staging) / replica)
    if node_rank is not None:
        staging, cache = (None if d is None else str(Path(d) / f"node_{node_rank}")
                          for d in (staging, cache))
    return RunPaths(run_dir, checkpoint_dir, staging, cache)

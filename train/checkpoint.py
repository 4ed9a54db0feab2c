"""The trainer's side of checkpointing: what to save, when, and resuming on start."""

from __future__ import annotations

import logging
import math
import time
from typing import Any, Callable, Dict, List, Optional

from omegaconf import DictConfig, OmegaConf

from checkpointing.manager import CheckpointManager, CheckpointOptions
from train.config import ResumeMode
from train.distributed import World
from train.errors import ConfigError
from train.faults import Faults
from train.state import Progress, RNGState, RunInfo, changed_keys
from train.tracking import flatten

log = logging.getLogger(__name__)

# Changing these makes a checkpoint meaningless for the run: refuse to resume across them.
IDENTITY_KEYS = ("model.name", "data.root")


def training_config(cfg: DictConfig) -> Dict[str, str]:
    """The resolved config minus keys that do not change what is trained."""
    flat = flatten(OmegaConf.to_container(cfg, resolve=True))
    ignored = list(cfg.run.exclude_keys) + ["checkpoint", "audit"]
    return {k: v for k, v in flat.items()
            if not any(k == p or k.startswith(p + ".") for p in ignored)}


def build_manager(cfg: DictConfig, world: World,
                  faults: Faults) -> Optional[CheckpointManager]:
    ck = cfg.checkpoint
    if not ck.enabled:
        return None
    try:
        options = CheckpointOptions(dir=ck.dir, staging_dir=ck.staging_dir,
                                    async_mode=ck.async_mode.value, keep_last=ck.keep_last,
                                    commit_timeout_s=ck.commit_timeout_s)
        manager = CheckpointManager(options, world.rank, world.world_size,
                                    world.checkpoint_group, fault_hook=faults.save_hook(),
                                    local_rank=world.local_rank)
    except ValueError as err:  # also a checkpoint.dir URL that fsspec cannot open
        raise ConfigError(str(err)) from None
    manager.check_storage()
    return manager


def resume(cfg: DictConfig, manager: Optional[CheckpointManager], state: Dict[str, Any],
           world: World, faults: Faults) -> Optional[str]:
    """Load the newest complete checkpoint into `state` as `checkpoint.resume` says.

    Returns the MLflow run id to keep logging into (None for a fresh start).
    """
    mode = cfg.checkpoint.resume
    if manager is None:
        return None
    exists = manager.has_any_checkpoint()
    if mode == ResumeMode.never:
        if exists:
            raise ConfigError(f"checkpoint.dir {cfg.checkpoint.dir} already holds checkpoints "
                              f"and checkpoint.resume=never: pick another run.name, or "
                              f"checkpoint.resume=auto to continue that run")
        return None
    info: RunInfo = state["run"]
    current_config = dict(info.config)
    # The header loads partially: a checkpoint saved before run names were recorded keeps
    # this one, and is judged by the identity keys alone.
    info.run_name = cfg.run.name

    def refuse_another_run() -> None:
        if info.run_name not in (None, cfg.run.name):
            raise ConfigError(
                f"checkpoint.dir {cfg.checkpoint.dir} holds checkpoints of another run "
                f"({info.run_name[:200]!r}), not of this run ({cfg.run.name}): give every run "
                f"a checkpoint.dir of its own, e.g. checkpoint.dir=/some/dir/${{run.name}} (the "
                f"default is ${{run.root}}/${{run.name}}/checkpoints), or run.name= that run's "
                f"name to continue it")
        refused = [k for k in changed_keys(info.config, current_config) if k in IDENTITY_KEYS]
        if refused:
            raise ConfigError(f"cannot resume {cfg.run.name}: {', '.join(refused)} changed "
                              f"since the checkpoint (that makes it a different run): use a "
                              f"new run.name")

    if exists:
        faults.at_load()
    step = manager.load_latest(state, optional_keys=rng_if_resized(world.world_size),
                               header=["run"], check_header=refuse_another_run)
    if step is None:
        if exists:
            raise ConfigError(f"{cfg.checkpoint.dir} holds checkpoints but none is complete "
                              f"(see the warnings above): remove them to start afresh, or "
                              f"point checkpoint.dir at a good copy")
        if mode == ResumeMode.required:
            raise ConfigError(f"checkpoint.resume=required but {cfg.checkpoint.dir} holds no "
                              f"checkpoint: check run.name / checkpoint.dir")
        return None
    progress: Progress = state["trainer"].progress
    if progress.step != step:
        raise ConfigError(f"checkpoint step_{step:09d} records step {progress.step}: "
                          f"it was not written by this trainer")
    changed = changed_keys(info.config, current_config)
    if changed:
        log.warning("resuming with changed config keys: %s", ", ".join(changed))
    rederive_rng_if_resized(manager, state, world.world_size, cfg.seed, step)
    run_id, info.config = info.mlflow_run_id, current_config
    return run_id


def rng_if_resized(world_size: int) -> Callable[[int], List[str]]:
    """Per-rank RNG streams only map onto ranks at the world size that saved them."""
    return lambda saved_world_size: ["rng"] if saved_world_size != world_size else []


def rederive_rng_if_resized(manager: CheckpointManager, state: Dict[str, Any],
                            world_size: int, seed: int, step: int) -> None:
    if "rng" in state and manager.last_loaded_world_size != world_size:
        rng: RNGState = state["rng"]
        rng.rederive(seed, step)


class CheckpointSchedule:
    """When to save: every `interval_steps`, or by Young/Daly when `auto_interval` is set,
    and always at the final step."""

    def __init__(self, cfg: DictConfig, start_step: int) -> None:
        self.interval = cfg.checkpoint.interval_steps  # >= 1: the schema's bounds
        self.auto = cfg.checkpoint.auto_interval
        self.mtbf_seconds = cfg.checkpoint.mtbf_hours * 3600
        self.last_save_step = start_step  # a resumed run is at a checkpoint already
        self.last_time = time.perf_counter()

    def due(self, step: int, final: bool) -> bool:
        return final or step - self.last_save_step >= self.interval

    def saved(self, step: int, manager: CheckpointManager) -> None:
        """Re-plan after a save: T = sqrt(2 * C * MTBF), C the measured stall; never more
        often than a save takes to finish in the background."""
        now = time.perf_counter()
        if self.auto and step > self.last_save_step:
            step_seconds = (now - self.last_time) / (step - self.last_save_step)
            optimal = math.sqrt(2 * max(manager.last_stall_seconds, 1e-3) * self.mtbf_seconds)
            floor = manager.last_save_seconds / max(step_seconds, 1e-9)
            self.interval = max(1, math.ceil(max(optimal / max(step_seconds, 1e-9), floor)))
            log.info("checkpoint interval: %d steps (Young/Daly: stall %.3fs, MTBF %.1fh)",
                     self.interval, manager.last_stall_seconds, self.mtbf_seconds / 3600)
        self.last_save_step, self.last_time = step, now


class Checkpointing:
    """The loop's handle on checkpoints: save when due, report what it cost."""

    def __init__(self, manager: CheckpointManager, state: Dict[str, Any],
                 schedule: CheckpointSchedule, world_size: int, seed: int) -> None:
        self.manager, self.state, self.schedule = manager, state, schedule
        self.world_size, self.seed = world_size, seed

    def due(self, step: int, final: bool) -> bool:
        return self.schedule.due(step, final)

    def save(self, step: int) -> float:
        """Start checkpoint `step`; returns how long the loop was blocked (seconds)."""
        self.manager.save(step, self.state)
        self.schedule.saved(step, self.manager)
        return self.manager.last_stall_seconds

    def roll_back(self) -> Optional[int]:
        """Load the newest complete checkpoint into the live state (None: there is none)."""
        self.manager.wait()  # a save in flight holds a good, newer state: let it land
        step = self.manager.load_latest(self.state, rng_if_resized(self.world_size),
                                        header=["run"])  # loads partially, as on resume
        if step is not None:
            rederive_rng_if_resized(self.manager, self.state, self.world_size, self.seed, step)
            self.schedule.last_save_step = step
        return step

    def metrics(self) -> Dict[str, float]:
        return {"checkpoint/save_seconds": self.manager.last_save_seconds,
                "checkpoint/failed_saves": float(self.manager.failed_saves)}

    def close(self) -> None:
        self.manager.close()

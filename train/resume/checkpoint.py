"""The trainer's side of checkpointing: what to save, when, and resuming on start."""

from __future__ import annotations

import logging
import math
import re
import statistics
import time
from collections import deque
from dataclasses import dataclass, replace
from typing import Any, Callable, Deque, Dict, List, Optional, Tuple

from omegaconf import DictConfig, OmegaConf

from checkpointing import plan as intervals
from checkpointing.claims import ClaimMismatch, check_step
from checkpointing.commit import step_dir_name
from checkpointing.manager import CheckpointManager, CheckpointOptions, PendingSave, SaveResult
from common.redact import strip_credentials
from train.records import events
from train.config import ResumeMode, changes_training
from train.cluster.rank_dirs import RunPaths
from train.cluster.world import World
from train.errors import ConfigError
from train.faults import NO_FAULTS, FaultHook
from train.resume.stateful import (DataIdentity, Position, RunInfo, changed_keys, position_state,
                                   read_position)
from train.tracking.tracker import flatten

log = logging.getLogger(__name__)

# Changing these makes a checkpoint meaningless for the run (or, the optimizer, its state
# unloadable): refuse to resume across them.
IDENTITY_KEYS = ("model.name", "data.root", "optim.name")


def training_config(cfg: DictConfig) -> Dict[str, str]:
    """The resolved config minus keys that do not change what is trained."""
    flat = flatten(OmegaConf.to_container(cfg, resolve=True))
    return {k: v for k, v in flat.items() if changes_training(k, cfg.run.exclude_keys)}


def build_manager(cfg: DictConfig, paths: RunPaths, world: World,
                  faults: FaultHook = NO_FAULTS) -> Optional[CheckpointManager]:
    ck = cfg.checkpoint
    if not ck.enabled:
        return None
    try:
        options = CheckpointOptions(dir=paths.checkpoint_dir, staging_dir=paths.staging_dir,
                                    async_mode=ck.async_mode.value, keep_last=ck.keep_last,
                                    commit_timeout_s=ck.commit_timeout_s,
                                    storage_options=OmegaConf.to_container(
                                        ck.storage_options, resolve=True),
                                    format=ck.format.value)
        manager = CheckpointManager(options, world.rank, world.world_size,
                                    world.control_group,
                                    fault_hook=lambda phase, step: faults.at(
                                        "save", phase=phase, step=step),
                                    local_rank=world.local_rank, node_rank=world.node_rank)
    except ValueError as err:  # also a checkpoint.dir URL that fsspec cannot open
        raise ConfigError(str(err)) from None
    manager.check_storage()
    return manager


class CheckpointSchedule:
    """When to save: every `interval_steps`, or with `auto_interval` at the exact
    exponential model's optimum (checkpointing.plan) for the measured stall and step time
    and `checkpoint.mtbf_hours`, re-picked after each save; always at the final step."""

    # Measures in each running median: the first save (buffers allocated, workers started)
    # and a save that met background contention must not swing the interval.
    WINDOW = 5
    # A new pick replaces the interval only when it differs by more than this share: goodput
    # is flat near the optimum (10% off it costs under 0.5% of the loss), so smaller moves
    # would be noise, logged at every save.
    CHANGE = 0.1

    def __init__(self, cfg: DictConfig, start_step: int) -> None:
        self.interval = cfg.checkpoint.interval_steps  # >= 1: the schema's bounds
        self.auto = cfg.checkpoint.auto_interval
        self.mtbf_seconds = cfg.checkpoint.mtbf_hours * 3600
        # Until a resume measures one: it sets the predicted goodput, not the interval.
        self.restart_seconds, self.restart_source = cfg.checkpoint.restart_seconds, "assumed"
        self.stalls: Deque[float] = deque(maxlen=self.WINDOW)
        self.saves: Deque[float] = deque(maxlen=self.WINDOW)
        self.steps: Deque[float] = deque(maxlen=self.WINDOW)
        self.last_save_step = start_step  # a resumed run is at a checkpoint already
        self.hopeless = False  # said once that no interval can help
        self.last_time = time.perf_counter()

    def due(self, step: int, final: bool) -> bool:
        return final or step - self.last_save_step >= self.interval

    def resumed(self, step: int, restore_seconds: float) -> None:
        """The process resumed at `step`, the load having taken `restore_seconds`."""
        self.last_save_step, self.last_time = step, time.perf_counter()
        self.restart_seconds, self.restart_source = restore_seconds, "measured at resume"

    def saved(self, step: int, stall_seconds: float, save_seconds: float) -> None:
        """A save at `step` blocked the loop `stall_seconds`; the last finished one took
        `save_seconds` in all (async: in the background). Pick the interval again from
        the medians."""
        now = time.perf_counter()
        if self.auto and step > self.last_save_step:
            self.stalls.append(stall_seconds)
            self.saves.append(save_seconds)
            work = max(now - self.last_time - stall_seconds, 0.0)
            self.steps.append(work / (step - self.last_save_step))
            self.repick_interval()
        self.last_save_step, self.last_time = step, now

    def repick_interval(self) -> None:
        """The exact model's optimum in steps, never shorter than a save takes to finish
        (one save at a time: a sooner one would wait for it, blocking the loop)."""
        stall, save, step = (statistics.median(m) for m in (self.stalls, self.saves, self.steps))
        step = max(step, 1e-9)
        if why := intervals.hopeless(save, self.mtbf_seconds):
            if not self.hopeless:  # once: it does not change from save to save
                log.warning("checkpoint.auto_interval: %s (checkpoint.mtbf_hours=%g): keeping "
                            "%d steps; give the job's real MTBF, or make saves faster "
                            "(checkpoint.async_mode)", why, self.mtbf_seconds / 3600,
                            self.interval)
            self.hopeless = True
            return
        optimum = intervals.exact_optimum(max(stall, 1e-6), self.mtbf_seconds)
        pick = max(1, math.ceil(max(optimum, save) / step))
        # One step is the finest move there is: 1 <-> 2 is not worth a line at every save
        if abs(pick - self.interval) <= max(self.CHANGE * self.interval, 1):
            return
        self.interval = pick
        goodput = intervals.exact_goodput(pick * step, stall, self.restart_seconds,
                                          self.mtbf_seconds)
        why = ("the save's own duration, above the optimum" if save > optimum else
               "the exact model's optimum")
        log.info("checkpoint interval: %d steps (%s of %.3fs steps), %s; median stall "
                 "%.3fs, save %.2fs, MTBF %s (checkpoint.mtbf_hours), restart %s (%s): "
                 "expected goodput %.1f%% (Young: %d steps)", pick,
                 intervals.duration(pick * step), step, why, stall, save,
                 intervals.duration(self.mtbf_seconds), intervals.duration(self.restart_seconds),
                 self.restart_source, 100 * goodput,
                 math.ceil(intervals.young_interval(max(stall, 1e-6), self.mtbf_seconds) / step))


@dataclass(frozen=True)
class Restored:
    """What a load found: where the run is, the world size that saved it, and the saved run's
    header (its MLflow run, config and name; the live one is never overwritten)."""

    position: Position
    saved_world_size: int
    run: RunInfo


class Checkpoints:
    """What the loop asks of checkpointing. This base, `NO_CHECKPOINTS`, is
    checkpoint.enabled=false: nothing is saved, so nothing restores or rolls back."""

    saves = False  # whether a stop (preemption) leaves a checkpoint to resume from

    def restore(self) -> Optional[Restored]:
        """Before the first step: the newest complete checkpoint, loaded (None: step 0)."""
        return None

    def save(self, position: Position, last_step: bool = False) -> float:
        """After each step: the seconds the loop was blocked saving (0.0: none was due)."""
        return 0.0

    def roll_back(self, at_most: Optional[int] = None) -> Optional[Restored]:
        """The newest complete checkpoint (at step `at_most` or before), loaded (None: none)."""
        return None

    def metrics(self) -> Dict[str, float]:
        return {}

    def close(self) -> None:
        """Wait until the last save is committed (raises if it failed)."""


NO_CHECKPOINTS = Checkpoints()


class RunCheckpoints(Checkpoints):
    """This run's checkpoints, as the trainer sees them: restores at start, saves when due
    (it decides), rolls back, and reports what saving cost; under it, `CheckpointManager`
    (checkpointing/manager.py) writes, verifies and reads one state dict as a checkpoint. `components` are the
    `Stateful` parts of a checkpoint; the position is passed in at each save and handed back
    by each load."""

    saves = True

    def __init__(self, cfg: DictConfig, manager: CheckpointManager,
                 components: Dict[str, Any], identity: DataIdentity, world_size: int,
                 faults: FaultHook = NO_FAULTS) -> None:
        self.cfg, self.manager, self.components = cfg, manager, components
        self.identity, self.world_size, self.faults = identity, world_size, faults
        self.schedule = CheckpointSchedule(cfg, start_step=0)
        self.stall_seconds = 0.0  # the last save's, for the schedule and the metrics
        # the save in flight and the wall time it began, until its landing is recorded
        self._landing: Optional[Tuple[PendingSave, float]] = None
        self._save_seconds = 0.0  # how long the newest recorded commit took
        self._failed_saves = 0

    def restore(self) -> Optional[Restored]:
        """Load the newest complete checkpoint of this run as `checkpoint.resume` says; None
        for a fresh start. Another run's checkpoint, or one whose identity keys changed,
        stops the run with a ConfigError."""
        ck, began = self.cfg.checkpoint, time.perf_counter()
        where = self.manager.options.dir
        exists = self.manager.has_any_checkpoint()
        if ck.resume == ResumeMode.never:
            if exists:
                raise ConfigError(f"checkpoint.dir {where} already holds checkpoints and "
                                  f"checkpoint.resume=never: pick another run.name, or "
                                  f"checkpoint.resume=auto to continue that run")
            return None
        if exists:
            self.faults.at("load")
        current: RunInfo = self.components["run"]
        header, unfit = replace(current, config=dict(current.config)), []

        def this_run(step: int) -> None:
            refuse_another_run(self.cfg, where, header, current.config)
            unfit.append(step)  # until its state loads too

        restored = self._load_newest(header, this_run)
        if restored is None:
            if unfit:
                raise unfit_checkpoints(self.cfg, where, unfit,
                                        changed_keys(header.config, current.config))
            if exists:
                raise ConfigError(f"{where} holds checkpoints but none is complete (see the "
                                  f"warnings above): remove them to start afresh, or point "
                                  f"checkpoint.dir at a good copy")
            if ck.resume == ResumeMode.required:
                raise ConfigError(f"checkpoint.resume=required but {where} holds no "
                                  f"checkpoint: check run.name / checkpoint.dir")
            return None
        events.record("resume", step=restored.position.step,
                      seconds=time.perf_counter() - began)
        self.schedule.resumed(restored.position.step, time.perf_counter() - began)
        changed = changed_keys(restored.run.config, current.config)
        if changed:
            log.warning("resuming with changed config keys: %s", ", ".join(changed))
        return restored

    def save(self, position: Position, last_step: bool = False) -> float:
        """Start a checkpoint of `position` if one is due (always at the last step); returns
        how long the loop was blocked (0.0 when none was due)."""
        self._record_landed()  # committed in the background since the last step, if it has
        if not self.schedule.due(position.step, final=last_step):
            return 0.0
        state = {**self.components, **position_state(position, self.identity)}
        began = time.time()
        pending = self.manager.save(position.step, state)
        self.stall_seconds = pending.stall_seconds
        self._record_landed()  # the previous save: the manager waited for it
        events.record_once("save_staged", step=position.step, stall=self.stall_seconds)
        self._landing = (pending, began)
        self.schedule.saved(position.step, self.stall_seconds, self._newest_save_seconds())
        return self.stall_seconds

    def roll_back(self, at_most: Optional[int] = None) -> Optional[Restored]:
        """The newest complete checkpoint (at step `at_most` or before, when given), loaded
        into the live state (None: there is none)."""
        self.manager.wait()  # a save in flight holds a good, newer state: let it land
        self._record_landed()
        current: RunInfo = self.components["run"]
        return self._load_newest(replace(current, config=dict(current.config)),
                                 at_most=at_most)

    def _load_newest(self, header: RunInfo, check_run: Callable[[int], None] = lambda step: None,
                     at_most: Optional[int] = None) -> Optional[Restored]:
        """The manager's newest complete checkpoint that loads (none after step `at_most`):
        the run header first, into `header` (partially: a checkpoint older than a header key
        keeps the value it holds), which `check_run` may refuse; then everything else but
        the live run header."""
        rest = {k: v for k, v in self.components.items() if k != "run"}
        loaded = {**rest, **position_state(Position(), self.identity)}
        found = self.manager.load_latest(
            loaded, lambda saved_world: ["rng"] if saved_world != self.world_size else [],
            header={"run": header}, check=check_run, at_most=at_most)
        if found is None:
            return None
        self.faults.at("loaded", state=loaded)
        position = read_position(loaded, self.identity)
        try:
            check_step(step_dir_name(found.step), position.step, found.step)
        except ClaimMismatch as err:
            raise ConfigError(str(err)) from None
        if found.world_size != self.world_size and "rng" in self.components:
            # per-rank RNG streams no longer map onto ranks
            self.components["rng"].rederive(self.cfg.seed, found.step)
        self.schedule.last_save_step = found.step
        return Restored(position, found.world_size, header)

    def metrics(self) -> Dict[str, float]:
        landed = self._landed()
        failed = self._failed_saves + (landed is not None and not landed.committed)
        return {"checkpoint/save_seconds": self._newest_save_seconds(),
                "checkpoint/failed_saves": float(failed)}

    def _landed(self) -> Optional[SaveResult]:
        """How the save in flight ended, if it has and its record is still to be made."""
        if self._landing is None or not self._landing[0].done():
            return None
        return self._landing[0].result()

    def _newest_save_seconds(self) -> float:
        """How long the newest committed save took (async_mode=off: the one just made)."""
        landed = self._landed()
        return landed.seconds if landed is not None and landed.committed else self._save_seconds

    def close(self) -> None:
        """Wait until the last save is committed (raises if it failed)."""
        try:
            self.manager.close()
        finally:
            self._record_landed()

    def _record_landed(self) -> None:
        """The timeline's record of how the save in flight ended, once it has landed:
        committed (at the time it landed) or failed."""
        landed = self._landed()
        if landed is None:
            return
        began, self._landing = self._landing[1], None
        if landed.committed:
            self._save_seconds = landed.seconds
            events.record_once("save_committed", at=began + landed.seconds, step=landed.step,
                               seconds=landed.seconds)
        else:
            self._failed_saves += 1
            events.record("save_failed", step=landed.step, error=landed.error[:300])


def refuse_another_run(cfg: DictConfig, where: str, saved: RunInfo,
                       current_config: Dict[str, str]) -> None:
    """Raise when the checkpoint in `where` whose header is in `saved` belongs to another
    run."""
    if saved.run_name not in (None, cfg.run.name):
        raise ConfigError(
            f"checkpoint.dir {where} holds checkpoints of another run "
            f"({saved.run_name[:200]!r}), not of this run ({cfg.run.name}): give every run "
            f"a checkpoint.dir of its own, e.g. checkpoint.dir=/some/dir/${{run.name}} (the "
            f"default is ${{run.root}}/${{run.name}}/checkpoints), or run.name= that run's "
            f"name to continue it")
    refused = [k for k in changed_keys(saved.config, current_config) if k in IDENTITY_KEYS]
    if refused:
        values = "; ".join(f"{k}={_typed(saved.config.get(k))} there, "
                           f"{_typed(current_config.get(k))} now" for k in refused)
        raise ConfigError(f"cannot resume {cfg.run.name}: {', '.join(refused)} changed since "
                          f"the checkpoint ({values}; that makes it a different run): set it "
                          f"back, or use a new run.name (the checkpoints are intact)")


def _typed(value: Optional[str]) -> str:
    """A recorded config value as it is typed: the record keeps an option by its Python name
    ('OptimizerName.sgd')."""
    text = strip_credentials(str(value))[:80]
    return re.sub(r"^[A-Z][A-Za-z]*\.(\w+)$", r"\1", text)


def unfit_checkpoints(cfg: DictConfig, checkpoint_dir: str, steps: List[int],
                      changed: List[str]) -> ConfigError:
    """Complete, verified checkpoints of this run in `checkpoint_dir` that do not load into
    its state: the config changed under them (never a reason to delete them)."""
    where = strip_credentials(checkpoint_dir)
    what = (f"config keys changed since they were saved: {', '.join(changed)[:300]}: set "
            f"them back, or use a new run.name (the checkpoints are intact: keep them)"
            if changed else
            f"no config key changed, so the warnings above say why: `python -m "
            f"checkpointing.verify {where}` re-checks them")
    return ConfigError(f"cannot resume {cfg.run.name}: {len(steps)} complete checkpoint(s) in "
                       f"{where} (steps {', '.join(map(str, steps[:5]))}) verify but do not "
                       f"load into this run's state (see the warnings above); {what}")

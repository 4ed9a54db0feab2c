"""`python -m train`: compose -> build data, model, optimizer -> train -> save weights."""

from __future__ import annotations

import logging
import random
import sys
import json
import time
from pathlib import Path
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from checkpointing.claims import SCHEMA_KEY, schema_of_state
from checkpointing.export import with_model_card
from checkpointing.manager import NO_SPACE, CheckpointError
from common.files import atomic_file
from common.distributed import broadcast_object
from common.run_files import GOODPUT_FILE
from data.errors import DatasetError
from common.redact import strip_credentials
from data.loader import eval_batches
from data.dataset import IMAGENET_MEAN, IMAGENET_STD
from data.pipeline import build_datasets, build_loader
from data.sampler import BatchPlan, GlobalBatchSampler, SplitBatchSampler
from train import job_start
from train.records import events
from train.resume.checkpoint import NO_CHECKPOINTS, RunCheckpoints, build_manager, training_config
from train.config import Device, LoggerName, Precision, StrategyName
from train.cluster.rank_dirs import RunPaths, run_paths
from train.cluster.world import World, init_world, launched_by_torchrun, shutdown_world
from train.errors import (EXIT_CONFIG, EXIT_PREEMPTED, EXIT_PREFLIGHT, ConfigError,
                          PreflightError, TrainingError)
from train.faults import FaultHook, Faults
from train.recovery.replicas import NO_REPLICAS, FaultTolerantReplicas, check_fault_tolerance
from train.records.goodput import Goodput
from train.recovery.health import HealthMonitor, HealthState, Watchdog
from train.loop import Job, Learner, LoopSettings, RunServices, evaluate, training_loop
from train.learn.model import build_model
from train.learn.optim import build_optimizer, build_scheduler
from train.learn.strategy import full_state_dict, parallelize
from train.cluster.preemption import Preempted, PreemptionFlag, catch_preemption
from train.cluster.preflight import preflight
from train.cluster.runlock import hold_run_lock
from train.resume.stateful import (DataIdentity, ModelState, OptimizerState, Position, RNGState,
                         RunInfo, SchedulerState)
from train.records.report import write_run_report
from train.tracking.tracker import Tracker, describe, parameter_counts, start_tracker

log = logging.getLogger(__name__)


def run(cfg: DictConfig) -> Dict[str, float]:
    """Train; a mistake the user can fix ends the process with one line and exit code 2."""
    with events.recording_exit():
        try:
            return run_process(cfg)
        except (ConfigError, DatasetError, CheckpointError, PreflightError,
                TrainingError) as err:
            print(f"error: {strip_credentials(str(err))}", file=sys.stderr)
            code = (EXIT_PREFLIGHT if isinstance(err, PreflightError)
                    else 1 if isinstance(err, TrainingError) else EXIT_CONFIG)
            raise SystemExit(code) from None
        except Preempted as stopped:
            log.warning("%s", stopped)
            stopped.hand_on()  # a launcher's own handler for the signal (submitit: requeue)
            raise SystemExit(EXIT_PREEMPTED) from None


def run_process(cfg: DictConfig) -> Dict[str, float]:
    """This process's part of the run: device, seeds, stop signals, process groups and the
    run lock around the job."""
    OmegaConf.resolve(cfg)  # fixes run.name now, while Hydra's runtime is known
    start = job_start()
    device = resolve_device(cfg.trainer.device)
    seed_everything(cfg.seed, device, cfg.trainer.deterministic)
    with catch_preemption(cfg.trainer.stop_signals) as preemption:  # from here on a signal stops at a checkpoint
        world = init_world(device, cfg.strategy.timeout_seconds,
                           cfg.strategy.init_timeout_seconds)
        try:
            paths = run_paths(cfg, cfg.strategy.fault_tolerance.replica_id
                              if cfg.strategy.name == StrategyName.ddp_ft else None,
                              world.node_rank if launched_by_torchrun() else None)
            with hold_run_lock(paths.run_dir, cfg.run.name, world):
                return run_job(cfg, paths, world, device, start, preemption)
        finally:
            shutdown_world()


def run_job(cfg: DictConfig, paths: RunPaths, world: World, device: torch.device,
            start: float, preemption: PreemptionFlag) -> Dict[str, float]:
    """Build -> resume -> the loop under the tracker."""
    run_dir = paths.run_dir
    log.info("run %s in %s on %s (rank %d of %d)", cfg.run.name, run_dir, device, world.rank,
             world.world_size)
    events.open_timeline(run_dir, world.rank, world.world_size, events.wall_clock(start),
                         lambda attempt: broadcast_object(attempt, world.control_group))
    faults = Faults.from_env(world.rank, run_dir)  # tests and demos only (GOODPUT_FAULT)
    tracker = start_tracker(cfg.logger, world)  # a dead store fails now, not after set-up
    if cfg.health.preflight:
        preflight(world, device, cfg.strategy.timeout_seconds, faults)
    job = build(cfg, paths, world, device, faults)
    start_at = resume(cfg, job, world)
    services = RunServices(tracker, Goodput(run_dir / GOODPUT_FILE if world.rank == 0
                                            else None, start),
                           Watchdog(cfg.health.hang_seconds if cfg.health.enabled else 0),
                           preemption, faults)
    return run_tracked(cfg, paths, job, world, start_at, services)


def build(cfg: DictConfig, paths: RunPaths, world: World, device: torch.device,
          faults: FaultHook) -> Job:
    """Data, model, optimizer, and what checkpoints them."""
    train_set, val_set = build_datasets(cfg.data, cfg.seed, paths.cache_dir)
    in_band = cfg.strategy.name == StrategyName.ddp_ft
    if in_band:
        check_fault_tolerance(cfg.trainer.grad_accum_steps, cfg.strategy.fault_tolerance)
    # ddp_ft splits each global batch among the step's participants, whatever their number
    batch_plan = BatchPlan(len(train_set), cfg.data.global_batch_size,
                           1 if in_band else world.world_size, cfg.trainer.grad_accum_steps)
    settings = loop_settings(cfg, batch_plan, device)
    log.info("%d train / %d val images, %d classes; %d steps of %d (%d per epoch, %d samples "
             "dropped per epoch)", len(train_set), len(val_set), train_set.num_classes,
             settings.total_steps, cfg.data.global_batch_size, batch_plan.steps_per_epoch,
             batch_plan.dropped_per_epoch)
    learner = build_learner(cfg, world, device, train_set.num_classes, settings)
    pin = device.type == "cuda"

    def loader_at(position: Position) -> torch.utils.data.DataLoader:
        split = replicas.split()
        sampler = (SplitBatchSampler(batch_plan, cfg.seed, *split, position.epoch,
                                     position.step_in_epoch) if split else
                   GlobalBatchSampler(batch_plan, cfg.seed, world.rank, position.epoch,
                                      position.step_in_epoch))
        return build_loader(train_set, sampler, cfg.data, pin)

    val_loader = build_loader(val_set, eval_batches(len(val_set), cfg.data.val_batch_size,
                                                    world.rank, world.world_size),
                              cfg.data, pin)
    # With the model's tensors recorded, export can tell the model's files from others
    card = {**model_card(cfg, train_set.index.classes),
            SCHEMA_KEY: schema_of_state(ModelState(learner.model).state_dict())}
    # The checkpoint records the card too, for checkpointing.export to pass on.
    info = RunInfo(mlflow_run_id=None, run_name=cfg.run.name,
                   config={**training_config(cfg), "model_card": json.dumps(card)})
    health_state = HealthState(cfg.health.median_window)
    components = stateful_parts(learner, world, info, health_state)
    faults.at("state", state=components)  # negative controls in tests only
    manager = build_manager(cfg, paths, world, faults)
    checkpoints = (RunCheckpoints(cfg, manager, components,
                                  DataIdentity(cfg.seed, len(train_set),
                                               cfg.data.global_batch_size),
                                  world.world_size, faults) if manager else NO_CHECKPOINTS)
    health = HealthMonitor(cfg.health, health_state, world.rank, paths.run_dir,
                           replicated=cfg.strategy.name in (StrategyName.ddp,
                                                            StrategyName.ddp_ft))
    replicas = (build_replicas(cfg, world, device, learner, health_state, faults) if in_band
                else NO_REPLICAS)
    return Job(settings, learner, loader_at, val_loader, info, health, checkpoints, card,
               replicas, {"train": train_set.index, "val": val_set.index})


def stateful_parts(learner: Learner, world: World, info: RunInfo,
                   health_state: HealthState) -> Dict[str, Any]:
    """What a checkpoint holds, as `Stateful` objects (the position is added at each save)."""
    return {"model": ModelState(learner.model, world.control_group),
            "optim": OptimizerState(learner.model, learner.optimizer),
            "scheduler": SchedulerState(learner.scheduler), "rng": RNGState(world.rank),
            "run": info, "health": health_state}


def build_replicas(cfg: DictConfig, world: World, device: torch.device, learner: Learner,
                   health_state: HealthState, faults: FaultHook) -> FaultTolerantReplicas:
    """ddp_ft: this trainer's membership of the replica groups (joined in `resume`)."""
    return FaultTolerantReplicas(cfg.strategy.fault_tolerance, world, device, learner.model,
                                 learner.optimizer, learner.scheduler, health_state, faults,
                                 training_config(cfg),
                                 cfg.health.replica_check_steps if cfg.health.enabled else 0)


def model_card(cfg: DictConfig, classes: List[str]) -> Dict[str, Any]:
    """The class of each output, and the input the model expects: RGB at image_size,
    normalized by mean and std (data/dataset.py)."""
    return {"model": cfg.model.name, "num_classes": len(classes), "classes": list(classes),
            "image_size": cfg.data.image_size, "mean": list(IMAGENET_MEAN),
            "std": list(IMAGENET_STD)}


def build_learner(cfg: DictConfig, world: World, device: torch.device, num_classes: int,
                  settings: LoopSettings) -> Learner:
    model = build_model(cfg.model, num_classes).to(device)
    # FSDP2 refuses non-contiguous (channels_last) parameters; channels_last inputs alone
    # still select the channels_last convolution kernels.
    if device.type == "cuda" and cfg.strategy.name != StrategyName.fsdp:
        model = model.to(memory_format=torch.channels_last)
    # Before the optimizer is built: FSDP replaces the parameters with sharded ones.
    model = parallelize(model, cfg.strategy, world, device)
    optimizer = build_optimizer(cfg.optim, model)
    scheduler = build_scheduler(cfg.scheduler, optimizer, settings.planned_steps,
                                settings.steps_per_epoch)
    return Learner(model, optimizer, scheduler)


@dataclass(frozen=True)
class StartAt:
    """Where this process starts: the position, and the MLflow run to log into again (that
    of the checkpoint it resumed from; None: a new one)."""

    position: Position
    mlflow_run_id: Optional[str] = None


def resume(cfg: DictConfig, job: Job, world: World) -> StartAt:
    """Where this process starts: the newest complete checkpoint of the run, or step 0."""
    restored = job.checkpoints.restore()
    position = restored.position if restored else Position()
    job.health.load_skips(lambda skipped: broadcast_object(skipped, world.control_group))
    position = job.replicas.join(position)  # ddp_ft: a healthy peer ahead is copied
    if position.step >= job.settings.total_steps:
        log.info("run %s is already complete at step %d: nothing to train (raise "
                 "trainer.max_epochs or trainer.max_steps to go on)", cfg.run.name,
                 position.step)
    return StartAt(position, restored.run.mlflow_run_id if restored else None)


def run_tracked(cfg: DictConfig, paths: RunPaths, job: Job, world: World, start_at: StartAt,
                services: RunServices) -> Dict[str, float]:
    """The loop under the MLflow run, then what ends a run: the last save committed, the
    report, the final weights."""
    tracker = services.tracker
    with tracker.run(cfg.run.name, paths.applied_to(cfg),  # MLflow: the paths as used
                     resume_run_id=start_at.mlflow_run_id, run_dir=paths.run_dir) as run_id:
        # every rank saves the same
        job.info.mlflow_run_id = broadcast_object(run_id, world.control_group)
        tracker.log_params(parameter_counts(job.learner.model))
        tracker.log_datasets(job.splits)
        metrics = training_loop(job, services, start_at.position)
        if start_at.position.step >= job.settings.total_steps:  # nothing was trained
            metrics = metrics_reached(cfg, job, world, tracker)
        finish(cfg, paths.run_dir, job, world, services)
        log.info("done in %.0fs: %s; %s", time.perf_counter() - services.goodput.process_start,
                 describe(metrics, ["train/loss", "val/loss", "val/top1"]),
                 services.goodput.summary())
    return metrics


def finish(cfg: DictConfig, run_dir: Path, job: Job, world: World,
           services: RunServices) -> None:
    """After the last step, every rank: the last save committed, the replica groups left,
    goodput and the report written, the final weights saved and logged (`run_dir`: this
    process's run directory)."""
    tracker = services.tracker
    job.checkpoints.close()
    job.replicas.close()
    services.goodput.save(ended=True)
    events.record("end", step=job.settings.total_steps)
    if world.rank == 0:
        write_run_report(run_dir, tracker)
        tracker.log_files([run_dir / GOODPUT_FILE])
    weights = (full_state_dict(job.learner.model) if wants_final_weights(cfg)
               else None)  # a collective: every rank
    if weights is not None and world.rank == 0:
        if cfg.trainer.save_final_weights:
            save_final_weights(with_model_card(weights, job.card), run_dir / "model_final.pt")
        log_final_model(cfg, weights, job.card, tracker)


def metrics_reached(cfg: DictConfig, job: Job, world: World,
                    tracker: Tracker) -> Dict[str, float]:
    """What a run that was already complete reached, for the sweeper that runs it again: the
    last values its MLflow run holds, or, where those lack `sweep.objective`, its last
    validation again (the final checkpoint's weights, so the same numbers)."""
    logged = broadcast_object(tracker.last_metrics(), world.control_group)
    if cfg.sweep.objective not in logged:
        logged.update(evaluate(job.learner.model, job.val_loader, job.settings,
                               job.replicas))  # every rank
    return logged


def wants_final_weights(cfg: DictConfig) -> bool:
    """Whether the final weights are gathered: for model_final.pt, or for MLflow."""
    return cfg.trainer.save_final_weights or (cfg.logger.name == LoggerName.mlflow
                                              and cfg.logger.log_model)


def log_final_model(cfg: DictConfig, weights: Dict[str, torch.Tensor], card: Dict[str, Any],
                    tracker: Tracker) -> None:
    """The final weights in a plain model on the CPU (no DDP/FSDP wrapper), as an MLflow
    model whose input example is two normalized images: MLflow exports the model with
    torch.export, which fixes a batch dimension of 1 for good."""
    model = build_model(cfg.model, card["num_classes"])
    model.load_state_dict(weights)
    size = card["image_size"]
    tracker.log_model(model.eval(), torch.zeros(2, 3, size, size), card)


def save_final_weights(weights: Dict[str, torch.Tensor], path: Path) -> None:
    """Whole or not at all (a full disk must not leave a truncated file over a good one);
    a full disk is the user's to fix, in one line."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_file(path) as f:
            torch.save(weights, f)
    except (OSError, RuntimeError) as err:
        # torch's zip writer reports the failed write as "unexpected pos", the OSError behind
        errors = (err, err.__cause__, err.__context__)
        if not any(isinstance(e, OSError) and e.errno in NO_SPACE for e in errors):
            raise
        raise ConfigError(f"no space left on device at {path.parent} for {path.name}: free "
                          f"space there, or set trainer.save_final_weights=false") from None


def resolve_device(choice: Device) -> torch.device:
    if choice == Device.auto:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if choice == Device.cuda and not torch.cuda.is_available():
        raise ConfigError("trainer.device=cuda but no CUDA device is visible: "
                          "use trainer.device=auto or trainer.device=cpu")
    return torch.device(choice.value)


def seed_everything(seed: int, device: torch.device, deterministic: bool) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    # On CUDA speed wins (cuDNN autotuning), whatever trainer.deterministic says.
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True
        return
    # On CPU deterministic mode reroutes only a few ops (index_put_/put_ with accumulate,
    # index_copy_), none of them in a torchvision classifier's step. Its cost was its other
    # half: filling every new tensor with NaN, a guard against reading uninitialised memory,
    # which no kernel of ours does (the resume tests compare bits); off, as measured in
    # docs/benchmarks.md.
    torch.use_deterministic_algorithms(deterministic)
    torch.utils.deterministic.fill_uninitialized_memory = False


def loop_settings(cfg: DictConfig, batch_plan: BatchPlan, device: torch.device) -> LoopSettings:
    trainer = cfg.trainer
    planned = trainer.max_epochs * batch_plan.steps_per_epoch
    total = min(planned, trainer.max_steps) if trainer.max_steps else planned
    bf16 = trainer.precision == Precision.bf16 or (
        trainer.precision == Precision.auto and device.type == "cuda")
    return LoopSettings(
        total_steps=total,
        planned_steps=planned,
        steps_per_epoch=batch_plan.steps_per_epoch,
        global_batch_size=batch_plan.global_batch_size,
        grad_accum_steps=trainer.grad_accum_steps,
        device=device,
        autocast_dtype=torch.bfloat16 if bf16 else None,
        val_every_steps=trainer.val_every_epochs * batch_plan.steps_per_epoch,
        log_every_steps=trainer.log_every_steps,
        image_size=cfg.data.image_size,
        grad_clip_norm=trainer.grad_clip_norm,
        label_smoothing=trainer.label_smoothing,
        audit_ledger=cfg.audit.ledger,
    )

"""`python -m train`: compose -> build data, model, optimizer -> train -> save weights."""

from __future__ import annotations

import logging
import random
import sys
import time
from pathlib import Path
from typing import Dict

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from checkpointing.manager import CheckpointError
from common.distributed import broadcast_object
from data.errors import DatasetError
from data.redact import strip_credentials
from data.loader import eval_batches
from data.pipeline import build_datasets, build_loader
from data.sampler import BatchPlan, GlobalBatchSampler
from train import PROCESS_START
from train.checkpoint import (CheckpointSchedule, Checkpointing, build_manager, resume,
                              training_config)
from train.config import Device, Precision, StrategyName
from train.distributed import World, init_world, launched_by_torchrun, shutdown_world
from train.errors import (EXIT_CONFIG, EXIT_PREEMPTED, EXIT_PREFLIGHT, ConfigError,
                          PreflightError, TrainingError)
from train.faults import Faults, omitted_state_keys
from train.goodput import Goodput
from train.health import Guard, HealthMonitor, HealthState, Watchdog
from train.launch import use_node_local_dirs
from train.loop import LoopPlan, fit
from train.model import build_model
from train.optim import build_optimizer, build_scheduler
from train.parallel import full_state_dict, parallelize
from train.preemption import Preempted, PreemptionFlag, catch_preemption
from train.preflight import preflight
from train.runlock import hold_run_lock
from train.state import (DataIdentity, DataState, ModelState, OptimizerState, Progress,
                         RNGState, RunInfo, SchedulerState, TrainerState)
from train.tracking import describe, start_tracker

log = logging.getLogger(__name__)


def run(cfg: DictConfig) -> Dict[str, float]:
    """Train; a mistake the user can fix ends the process with one line and exit code 2."""
    try:
        return train(cfg)
    except (ConfigError, DatasetError, CheckpointError) as err:
        print(f"error: {strip_credentials(str(err))}", file=sys.stderr)
        raise SystemExit(EXIT_CONFIG) from None
    except PreflightError as err:
        print(f"error: {strip_credentials(str(err))}", file=sys.stderr)
        raise SystemExit(EXIT_PREFLIGHT) from None
    except TrainingError as err:
        print(f"error: {strip_credentials(str(err))}", file=sys.stderr)
        raise SystemExit(1) from None
    except Preempted as stopped:
        log.warning("%s", stopped)
        raise SystemExit(EXIT_PREEMPTED) from None


def train(cfg: DictConfig) -> Dict[str, float]:
    OmegaConf.resolve(cfg)  # fixes run.name now, while Hydra's runtime is known
    start = PROCESS_START
    device = resolve_device(cfg.trainer.device)
    seed_everything(cfg.seed, device)
    with catch_preemption() as preemption:  # from here on a signal stops at a checkpoint
        world = init_world(device, cfg.strategy.timeout_seconds,
                           cfg.strategy.init_timeout_seconds)
        try:
            with hold_run_lock(Path(cfg.run.root) / cfg.run.name, cfg.run.name, world):
                use_node_local_dirs(cfg, world.node_rank if launched_by_torchrun() else None)
                return train_in_world(cfg, world, device, start, preemption)
        finally:
            shutdown_world()


def train_in_world(cfg: DictConfig, world: World, device: torch.device,
                   start: float, preemption: PreemptionFlag) -> Dict[str, float]:
    run_dir = Path(cfg.run.root) / cfg.run.name
    log.info("run %s in %s on %s (rank %d of %d)", cfg.run.name, run_dir, device, world.rank,
             world.world_size)
    faults = Faults.from_env(world.rank, run_dir)  # tests and demos only (GOODPUT_FAULT)
    tracker = start_tracker(cfg.logger, world)  # a dead store fails now, not after set-up
    if cfg.health.preflight:
        preflight(world, device, cfg.strategy.timeout_seconds, faults)

    train_set, val_set = build_datasets(cfg.data, cfg.seed)
    batch_plan = BatchPlan(len(train_set), cfg.data.global_batch_size, world.world_size,
                           cfg.trainer.grad_accum_steps)
    loop_plan = make_loop_plan(cfg, batch_plan, device)
    log.info("%d train / %d val images, %d classes; %d steps of %d (%d per epoch, %d samples "
             "dropped per epoch)", len(train_set), len(val_set), train_set.num_classes,
             loop_plan.total_steps, cfg.data.global_batch_size, batch_plan.steps_per_epoch,
             batch_plan.dropped_per_epoch)

    model = build_model(cfg.model, train_set.num_classes).to(device)
    # FSDP2 refuses non-contiguous (channels_last) parameters; channels_last inputs alone
    # still select the channels_last convolution kernels.
    if device.type == "cuda" and cfg.strategy.name != StrategyName.fsdp:
        model = model.to(memory_format=torch.channels_last)
    # Before the optimizer is built: FSDP replaces the parameters with sharded ones.
    model = parallelize(model, cfg.strategy, world, device)
    optimizer = build_optimizer(cfg.optim, model)
    scheduler = build_scheduler(cfg.scheduler, optimizer, loop_plan.planned_steps,
                                batch_plan.steps_per_epoch)

    progress = Progress()
    info = RunInfo(mlflow_run_id=None, config=training_config(cfg))
    state = {"model": ModelState(model, world.checkpoint_group),
             "optim": OptimizerState(model, optimizer),
             "scheduler": SchedulerState(scheduler), "trainer": TrainerState(progress),
             "data": DataState(progress, DataIdentity(cfg.seed, len(train_set),
                                                      cfg.data.global_batch_size)),
             "rng": RNGState(world.rank), "run": info,
             "health": HealthState(cfg.health.median_window)}
    for key in omitted_state_keys():  # negative controls in tests only (GOODPUT_FAULT)
        del state[key]
    manager = build_manager(cfg, world, faults)
    resumed_run_id = resume(cfg, manager, state, world, faults)
    health = HealthMonitor(cfg.health, state["health"], world.rank, run_dir,
                           replicated=cfg.strategy.name == StrategyName.ddp)
    health.load_skips()
    state["health"].skipped = set(broadcast_object(sorted(state["health"].skipped),
                                                   world.checkpoint_group))

    pin = device.type == "cuda"

    def train_loader_at(position: Progress) -> torch.utils.data.DataLoader:
        sampler = GlobalBatchSampler(batch_plan, cfg.seed, world.rank, position.epoch,
                                     position.step_in_epoch)
        return build_loader(train_set, sampler, cfg.data, pin)

    val_loader = build_loader(val_set, eval_batches(len(val_set), cfg.data.val_batch_size,
                                                    world.rank, world.world_size),
                              cfg.data, pin)
    checkpoints = (Checkpointing(manager, state, CheckpointSchedule(cfg, progress.step),
                                 world.world_size, cfg.seed) if manager else None)
    guard = Guard(health, faults,
                  Watchdog(cfg.health.hang_seconds if cfg.health.enabled else 0), preemption)

    if progress.step >= loop_plan.total_steps:
        log.info("run %s is already complete at step %d: nothing to train (raise "
                 "trainer.max_epochs or trainer.max_steps to go on)", cfg.run.name,
                 progress.step)
    with tracker.run(cfg.run.name, cfg, resume_run_id=resumed_run_id) as run_id:
        # every rank saves the same
        info.mlflow_run_id = broadcast_object(run_id, world.checkpoint_group)
        goodput = Goodput(run_dir / "goodput.json" if world.rank == 0 else None, start)
        metrics = fit(model, optimizer, scheduler, train_loader_at, val_loader, loop_plan,
                      progress, guard, goodput, checkpoints, tracker)
        if checkpoints:
            checkpoints.close()
        goodput.save(ended=True)
    weights = full_state_dict(model) if cfg.trainer.save_final_weights else None  # all ranks
    if weights is not None and world.rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        torch.save(weights, run_dir / "model_final.pt")
    log.info("done in %.0fs: %s; %s", time.perf_counter() - start,
             describe(metrics, ["train/loss", "val/loss", "val/top1"]), goodput.summary())
    return metrics


def resolve_device(choice: Device) -> torch.device:
    if choice == Device.auto:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if choice == Device.cuda and not torch.cuda.is_available():
        raise ConfigError("trainer.device=cuda but no CUDA device is visible: "
                          "use trainer.device=auto or trainer.device=cpu")
    return torch.device(choice.value)


def seed_everything(seed: int, device: torch.device) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    # Same config + same seed = same bits on CPU. On CUDA speed wins (cuDNN autotuning).
    if device.type == "cpu":
        torch.use_deterministic_algorithms(True)
    else:
        torch.backends.cudnn.benchmark = True


def make_loop_plan(cfg: DictConfig, batch_plan: BatchPlan, device: torch.device) -> LoopPlan:
    trainer = cfg.trainer
    planned = trainer.max_epochs * batch_plan.steps_per_epoch
    total = min(planned, trainer.max_steps) if trainer.max_steps else planned
    bf16 = trainer.precision == Precision.bf16 or (
        trainer.precision == Precision.auto and device.type == "cuda")
    return LoopPlan(
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

"""The training loop. Read it top to bottom: fetch a global batch, step, judge, save, log,
evaluate; `optimizer_step` is the math of one step."""

from __future__ import annotations

import logging
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, Iterator, List, NoReturn, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from common.distributed import any_rank
from data.dataset import normalize
from data.ledger import LedgerWriter, open_ledger
from data.loader import Batch
from data.metrics import data_metrics, record_batches
from train.records import events
from train.resume.checkpoint import NO_CHECKPOINTS, Checkpoints
from train.errors import TrainingError
from train.faults import NO_FAULTS, FaultHook
from train.recovery.replicas import NO_REPLICAS, Replicas, StepNotCommitted
from train.records.goodput import Goodput
from train.recovery.health import HealthMonitor, Watchdog
from train.learn.strategy import gradient_sync, runs_in_lockstep
from train.cluster.preemption import Preempted, PreemptionFlag
from train.tracking.progress import ProgressBar
from train.resume.stateful import Position, RunInfo
from train.tracking.tracker import Tracker, describe

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoopSettings:
    """The loop's numbers, worked out once from the config (`app.loop_settings`)."""

    total_steps: int  # optimizer steps this run ends at
    planned_steps: int  # trainer.max_epochs worth: what the lr schedule spans
    steps_per_epoch: int
    global_batch_size: int
    grad_accum_steps: int
    device: torch.device
    autocast_dtype: Optional[torch.dtype]  # None = full precision
    val_every_steps: int
    log_every_steps: int
    image_size: int  # data.image_size: the shape of stand-in forwards (runs_in_lockstep)
    grad_clip_norm: Optional[float] = None
    label_smoothing: float = 0.0
    audit_ledger: Optional[str] = None  # audit.ledger: a JSON line per step per rank


@dataclass
class Window:
    """What happened since the last log line: the source of every train/ and data/ metric."""

    start: float = field(default_factory=time.perf_counter)
    losses: List[torch.Tensor] = field(default_factory=list)
    fetch_seconds: List[float] = field(default_factory=list)
    checkpoint_stall_seconds: float = 0.0

    def summary(self, lr: float, images: int) -> Dict[str, float]:
        fetch = torch.tensor(self.fetch_seconds, dtype=torch.float64)
        return {
            "train/loss": torch.stack(self.losses).mean().item(),
            "train/lr": lr,
            "train/images_per_second": images / (time.perf_counter() - self.start),
            "data/fetch_seconds": fetch.mean().item(),
            "data/fetch_seconds_p99": torch.quantile(fetch, 0.99).item(),
            "checkpoint/stall_seconds": self.checkpoint_stall_seconds,
        }


@dataclass
class Learner:
    """What learns: the model, its optimizer and the learning-rate schedule."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler


@dataclass
class Job:
    """What `app.build` made for this process, the loop's one input: read by `app.resume`,
    then by `training_loop`."""

    settings: LoopSettings
    learner: Learner
    loader_at: Callable[[Position], torch.utils.data.DataLoader]  # train batches from there
    val_loader: torch.utils.data.DataLoader
    info: RunInfo  # this run's MLflow run and config, as its checkpoints record them
    health: HealthMonitor
    checkpoints: Checkpoints = NO_CHECKPOINTS  # checkpoint.enabled=false: none
    card: Dict[str, Any] = field(default_factory=dict)  # for a user of the final model
    replicas: Replicas = NO_REPLICAS  # ddp_ft: the replica groups this one trains with
    splits: Dict[str, Any] = field(default_factory=dict)  # the data.index.DatasetIndex of each


@dataclass
class RunServices:
    """What serves the loop for this process, around the job: where metrics and the
    timeline's goodput go, what watches for hangs and stop signals, and the faults of tests."""

    tracker: Tracker
    goodput: Goodput
    watchdog: Watchdog
    preemption: PreemptionFlag
    faults: FaultHook = NO_FAULTS


@dataclass(frozen=True)
class StepOutcome:
    """One trained step and the verdict every rank agreed on."""

    loss: torch.Tensor
    problem: Optional[str]  # why the step must not count (then it is rolled back)
    skip_batch: bool  # the problem was the data's: skip this global batch from now on
    stop: bool  # some rank was asked to stop (preemption)
    redo: Optional[str] = None  # ddp_ft: why the replica groups did not commit the step


def training_loop(job: Job, run: RunServices, position: Position) -> Dict[str, float]:
    """Train from `position` to `total_steps` optimizer steps; returns the last metrics of
    each kind. `position` is the one record of where the run is: each step, skip and
    rollback hands back the next one (and under ddp_ft, a heal from a peer)."""
    settings, last = job.settings, dict[str, float]()
    run.goodput.started(position.step)
    loader = job.loader_at(position)
    began, first_step = time.perf_counter(), position.step + 1  # the workers start at iter()
    batches, window = iter(loader), Window()
    with open_ledger(settings.audit_ledger) or nullcontext() as ledger, \
            ProgressBar(settings.total_steps, position.step) as bar, run.watchdog:
        while position.step < settings.total_steps:
            step = position.step + 1
            run.watchdog.beat()
            if (regrouped := job.replicas.start_step(position)) is not None:
                # ddp_ft: other participants (the global batch is split anew), or this group
                # healed from a peer: the batches from there
                position, (loader, batches) = regrouped, batches_at(job, regrouped)
                continue
            micro_batches, data_wait = fetch_global_batch(batches, settings.grad_accum_steps,
                                                          window)
            record_batches(loader, micro_batches)
            if step == first_step:
                last.update(log_first_batch(run.tracker, began, step))
            if job.health.skipped(step):  # a rollback ruled this global batch out
                record_step(ledger, job, step, micro_batches, None)
                position = advance(job.learner, position, settings)
                run.goodput.step_done(step, data_wait, stall=0.0)
                continue
            outcome = step_and_judge(job, run, micro_batches, step)
            if outcome.redo:  # ddp_ft: a replica group failed during the step
                redo(outcome, step, job, run)
                continue
            if outcome.problem:
                position = roll_back(outcome, step, job, run)
                (loader, batches), window = batches_at(job, position), Window()
                continue
            window.losses.append(outcome.loss)
            record_step(ledger, job, step, micro_batches, outcome.loss)
            position = advance(job.learner, position, settings)
            last_step = step == settings.total_steps
            stall = job.checkpoints.save(position, last_step=last_step or outcome.stop)
            window.checkpoint_stall_seconds += stall
            run.goodput.step_done(step, data_wait, stall)
            if outcome.stop:
                stop_for_preemption(step, job, run)
            if step % settings.log_every_steps == 0 or last_step:
                last.update(log_window(window, job, run, loader, step, bar))
                window = Window()
            if step % settings.val_every_steps == 0 or last_step:
                last.update(validate(job, run, step))
    return last


def batches_at(job: Job, position: Position) -> Tuple[torch.utils.data.DataLoader,
                                                      Iterator[Batch]]:
    """The train loader from `position` on, and its batches."""
    loader = job.loader_at(position)
    return loader, iter(loader)


def step_and_judge(job: Job, run: RunServices, micro_batches: List[Batch],
                   step: int) -> StepOutcome:
    """Train `step`, then judge it: the health checks' all-reduce also carries this rank's
    stop request, so every rank agrees on both verdicts (ddp_ft: every group too, on the
    parameter check, which rode on the step's own all-reduce)."""
    learner, faults = job.learner, run.faults
    faults.at("step", step=step)
    try:
        loss, grad_norm = optimizer_step(learner.model, learner.optimizer, micro_batches,
                                         job.settings, job.replicas)
    except StepNotCommitted as failed:  # nothing was applied: drop the partial gradients
        learner.optimizer.zero_grad(set_to_none=True)
        return StepOutcome(torch.zeros(()), None, False, False, redo=str(failed))
    faults.at("loss", step=step, loss=loss)
    faults.at("stepped", step=step, model=learner.model)
    bad_batch, stop = job.health.check_step(step, loss, grad_norm, run.preemption.requested())
    # Only a bad batch is skipped: replica drift is not the data's fault.
    drift = None if bad_batch else (job.health.check_replicas(step, learner.model)
                                    or job.replicas.drift())
    return StepOutcome(loss, bad_batch or drift, bool(bad_batch), stop)


def advance(learner: Learner, position: Position, settings: LoopSettings) -> Position:
    """The step is done (or skipped): the schedule moves on, and so does the position."""
    learner.scheduler.step()
    return position.advanced(settings.steps_per_epoch)


def log_first_batch(tracker: Tracker, began: float, step: int) -> Dict[str, float]:
    """How long the first global batch took to arrive (start-up of the input pipeline)."""
    first = {"data/first_batch_seconds": time.perf_counter() - began}
    tracker.log_metrics(first, 0)
    events.record("first_step", step=step)
    return first


def log_window(window: Window, job: Job, run: RunServices,
               loader: torch.utils.data.DataLoader, step: int,
               bar: ProgressBar) -> Dict[str, float]:
    """The metrics of the steps since the last log line: logged, drawn, and returned."""
    metrics = window.summary(job.learner.scheduler.get_last_lr()[0],
                             len(window.losses) * job.settings.global_batch_size)
    metrics.update(data_metrics(loader))
    metrics.update(job.checkpoints.metrics())
    metrics.update(run.goodput.metrics())
    metrics.update(job.replicas.metrics())
    run.goodput.save()
    events.progress(step)
    run.tracker.log_metrics(metrics, step)
    bar.update(step, metrics)
    return metrics


def validate(job: Job, run: RunServices, step: int) -> Dict[str, float]:
    metrics = evaluate(job.learner.model, job.val_loader, job.settings, job.replicas,
                       run.watchdog.beat)
    run.tracker.log_metrics(metrics, step)
    log.info("step %d epoch %.2f: %s", step, step / job.settings.steps_per_epoch,
             describe(metrics))
    return metrics


def record_step(ledger: Optional[LedgerWriter], job: Job, step: int,
                micro_batches: List[Batch], loss: Optional[torch.Tensor]) -> None:
    """The audit ledger's line for this rank's part of `step` (loss None: skipped; under
    ddp_ft the rank and world of a step whose width was chosen step by step)."""
    if ledger:
        samples = torch.cat([b.indices for b in micro_batches]).tolist()
        ledger.record(step, (step - 1) // job.settings.steps_per_epoch, samples,
                      None if loss is None else loss.item(), **job.replicas.ledger_slot())


def stop_for_preemption(step: int, job: Job, run: RunServices) -> NoReturn:
    """Every rank, once all agreed to stop after `step` (whose checkpoint has been started):
    wait until that checkpoint is committed, then raise `Preempted`."""
    job.checkpoints.close()  # raises CheckpointError if the save failed
    run.goodput.save()
    raise Preempted(run.preemption.signal_name or "a signal to another rank", step,
                    saved=job.checkpoints.saves)


def redo(outcome: StepOutcome, step: int, job: Job, run: RunServices) -> None:
    """ddp_ft: the replica groups did not commit `step`: it is trained again, its time lost."""
    log.warning("%s: redoing it with the groups that are left", outcome.redo)
    job.replicas.redo()
    run.goodput.rolled_back(step, step - 1, time.perf_counter())


def roll_back(outcome: StepOutcome, step: int, job: Job, run: RunServices) -> Position:
    """Every rank: back to the newest complete checkpoint (at the newest step the replica
    groups trust, under ddp_ft), with `step`'s global batch skipped from now on if it was
    the data's fault. Returns the restored position."""
    began, health = time.perf_counter(), job.health
    health.count_rollback()  # fails the run past health.max_rollbacks
    if outcome.skip_batch:
        health.skip(step)
    skipped = f"; step {step}'s global batch is skipped" if outcome.skip_batch else ""
    restored = job.checkpoints.roll_back(job.replicas.trusted_step())
    if restored is None:
        raise TrainingError(f"{outcome.problem}, and no checkpoint to roll back to: run the "
                            f"same command again (torchrun --max-restarts does it by itself)"
                            + skipped.replace("is skipped", "will be skipped"))
    log.warning("%s: rolled back to step %d%s (rollback %d of at most %d)", outcome.problem,
                restored.position.step, skipped, health.rollbacks, health.cfg.max_rollbacks)
    run.tracker.log_metrics({"health/rollbacks": float(health.rollbacks)}, step)
    events.record("fault", source="health", error=outcome.problem, step=step)
    events.record("rollback", step=step, to_step=restored.position.step,
                  seconds=time.perf_counter() - began)
    if outcome.skip_batch:
        run.tracker.log_metrics({"health/skipped_step": float(step)}, step)
    run.goodput.rolled_back(step, restored.position.step, began)
    return restored.position


def fetch_global_batch(batches: Iterator[Batch], grad_accum_steps: int,
                       window: Window) -> Tuple[List[Batch], float]:
    """The micro-batches of one optimizer step, and how long the loop waited for them (each
    `next()` is timed as data wait)."""
    micro_batches = []
    for _ in range(grad_accum_steps):
        t0 = time.perf_counter()
        micro_batches.append(next(batches))
        window.fetch_seconds.append(time.perf_counter() - t0)
    return micro_batches, sum(window.fetch_seconds[-grad_accum_steps:])


def autocast(settings: LoopSettings):
    if settings.autocast_dtype is None:
        return nullcontext()
    return torch.autocast(settings.device.type, dtype=settings.autocast_dtype)


def to_device(batch: Batch, device: torch.device) -> Tuple[torch.Tensor, torch.Tensor]:
    images, labels = batch.images, batch.labels
    images = normalize(images.to(device, non_blocking=True))
    if device.type == "cuda":
        images = images.contiguous(memory_format=torch.channels_last)
    return images, labels.to(device, non_blocking=True)


def optimizer_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                   micro_batches: List[Batch], settings: LoopSettings,
                   replicas: Replicas) -> Tuple[torch.Tensor, torch.Tensor]:
    """The math of one step: forward and backward over the micro-batches, then one optimizer
    step; returns the mean loss and the total gradient norm before clipping (both 0-dim on
    the device; the norm is the same on every rank)."""
    model.train()
    total = torch.zeros((), device=settings.device)
    last = len(micro_batches) - 1
    for i, batch in enumerate(micro_batches):
        # Gradients accumulate locally; the last micro-batch's backward averages the sum.
        with gradient_sync(model, replicas, enabled=i == last):
            if len(batch.labels) == 0:  # every sample of it was a skipped bad file
                if runs_in_lockstep(model, replicas):  # the others' backward waits for this
                    (stand_in_forward(model, settings).sum() * 0).backward()
                continue
            images, labels = to_device(batch, settings.device)
            with autocast(settings):
                logits = model(images)
            loss = F.cross_entropy(logits.float(), labels,
                                   label_smoothing=settings.label_smoothing)
            (loss / len(micro_batches)).backward()
        total += loss.detach() / len(micro_batches)
    grad_norm = gradient_norm(model, settings.grad_clip_norm)
    if isinstance(grad_norm, DTensor):
        grad_norm = grad_norm.full_tensor()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return total, grad_norm


def gradient_norm(model: torch.nn.Module, clip_norm: Optional[float]) -> torch.Tensor:
    """The total gradient norm (the health check reads it), clipping to `clip_norm` if set.
    Without a limit it only measures: clip_grad_norm_(inf) would also rewrite every gradient
    (times 1.0), a pass over all of them that cost a few percent of a ResNet-18 step on CPU.
    Under FSDP each rank holds shards, and the norm is a DTensor still to be summed."""
    if clip_norm:
        return torch.nn.utils.clip_grad_norm_(model.parameters(), clip_norm)
    return torch.nn.utils.get_total_norm(
        [p.grad for p in model.parameters() if p.grad is not None])


def stand_in_forward(model: torch.nn.Module, settings: LoopSettings) -> torch.Tensor:
    """A forward of one blank image, for a rank that has no samples where the others do. In
    eval mode, so it leaves BatchNorm statistics and the dropout RNG alone."""
    was_training = model.training
    model.eval()
    try:
        size = settings.image_size
        return model(torch.zeros(1, 3, size, size, device=settings.device))
    finally:
        model.train(was_training)


def in_lockstep(model: torch.nn.Module, replicas: Replicas, batches: Iterable[Batch],
                device: torch.device) -> Iterator[Optional[Batch]]:
    """`batches`, then None until every rank has run out of them, where the ranks' forwards
    are collectives (they may hold different numbers of batches)."""
    if not runs_in_lockstep(model, replicas):
        yield from batches
        return
    remaining = iter(batches)
    while True:
        batch = next(remaining, None)
        if not any_rank(batch is not None, device):
            return
        yield batch


@torch.no_grad()
def evaluate(model: torch.nn.Module, loader: torch.utils.data.DataLoader,
             settings: LoopSettings, replicas: Replicas,
             beat: Callable[[], None] = lambda: None) -> Dict[str, float]:
    """Mean loss and top-1 over the whole validation split (summed over ranks)."""
    model.eval()
    sums = torch.zeros(3, dtype=torch.float64, device=settings.device)  # loss, correct, count
    for batch in in_lockstep(model, replicas, loader, settings.device):
        beat()  # evaluating is progress: the hang watchdog must not fire on a long pass
        if batch is None or len(batch.labels) == 0:  # none left, or only skipped bad files
            if runs_in_lockstep(model, replicas):
                stand_in_forward(model, settings)
            continue
        images, labels = to_device(batch, settings.device)
        with autocast(settings):
            logits = model(images).float()
        sums[0] += F.cross_entropy(logits, labels, reduction="sum")
        sums[1] += (logits.argmax(dim=1) == labels).sum()
        sums[2] += labels.numel()
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(sums)
    model.train()
    loss, correct, count = sums.tolist()
    return {"val/loss": loss / count, "val/top1": correct / count}

"""The training loop. Read it top to bottom: fetch a global batch, step, log, evaluate."""

from __future__ import annotations

import logging
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Dict, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

from data.dataset import normalize
from data.ledger import open_ledger
from data.loader import Batch
from data.metrics import data_metrics, record_batches
from train.checkpoint import Checkpointing
from train.progress import StepProgress
from train.state import Progress
from train.tracking import NullTracker, describe

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoopPlan:
    total_steps: int  # optimizer steps this run ends at
    planned_steps: int  # trainer.max_epochs worth: what the lr schedule spans
    steps_per_epoch: int
    global_batch_size: int
    grad_accum_steps: int
    device: torch.device
    autocast_dtype: Optional[torch.dtype]  # None = full precision
    val_every_steps: int
    log_every_steps: int
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


def fit(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler, train_loader: torch.utils.data.DataLoader,
        val_loader: torch.utils.data.DataLoader, plan: LoopPlan, position: Progress,
        checkpoints: Optional[Checkpointing] = None,
        tracker: NullTracker = NullTracker()) -> Dict[str, float]:
    """Train from `position` to `plan.total_steps` optimizer steps; returns the last metrics
    of each kind."""
    last: Dict[str, float] = {}
    batches = iter(train_loader)
    start = time.perf_counter()
    window = Window()
    ledger = open_ledger(plan.audit_ledger)
    first_step = position.step + 1
    with ledger or nullcontext(), StepProgress(plan.total_steps, position.step) as progress:
        for step in range(first_step, plan.total_steps + 1):
            micro_batches = fetch_global_batch(batches, plan.grad_accum_steps, window)
            record_batches(train_loader, micro_batches)
            if step == first_step:
                first = {"data/first_batch_seconds": time.perf_counter() - start}
                tracker.log_metrics(first, 0)
                last.update(first)
            loss = train_step(model, optimizer, micro_batches, plan)
            window.losses.append(loss)
            if ledger:
                ledger.record(step, (step - 1) // plan.steps_per_epoch,
                              torch.cat([b.indices for b in micro_batches]).tolist(), loss.item())
            scheduler.step()
            position.advance(plan.steps_per_epoch)

            if checkpoints and checkpoints.due(step, final=step == plan.total_steps):
                window.checkpoint_stall_seconds += checkpoints.save(step)

            if step % plan.log_every_steps == 0 or step == plan.total_steps:
                steps_in_window = len(window.losses)
                metrics = window.summary(scheduler.get_last_lr()[0],
                                         steps_in_window * plan.global_batch_size)
                metrics.update(data_metrics(train_loader))
                if checkpoints:
                    metrics.update(checkpoints.metrics())
                tracker.log_metrics(metrics, step)
                progress.update(step, metrics)
                last.update(metrics)
                window = Window()

            if step % plan.val_every_steps == 0 or step == plan.total_steps:
                metrics = evaluate(model, val_loader, plan)
                tracker.log_metrics(metrics, step)
                log.info("step %d epoch %.2f: %s", step, step / plan.steps_per_epoch,
                         describe(metrics))
                last.update(metrics)
    return last


def fetch_global_batch(batches: Iterator[Batch], grad_accum_steps: int,
                       window: Window) -> List[Batch]:
    """The micro-batches of one optimizer step; each `next()` is timed as data wait."""
    micro_batches = []
    for _ in range(grad_accum_steps):
        t0 = time.perf_counter()
        micro_batches.append(next(batches))
        window.fetch_seconds.append(time.perf_counter() - t0)
    return micro_batches


def autocast(plan: LoopPlan):
    if plan.autocast_dtype is None:
        return nullcontext()
    return torch.autocast(plan.device.type, dtype=plan.autocast_dtype)


def to_device(batch: Batch, device: torch.device) -> Tuple[torch.Tensor, torch.Tensor]:
    images, labels = batch.images, batch.labels
    images = normalize(images.to(device, non_blocking=True))
    if device.type == "cuda":
        images = images.contiguous(memory_format=torch.channels_last)
    return images, labels.to(device, non_blocking=True)


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
               micro_batches: List[Batch], plan: LoopPlan) -> torch.Tensor:
    """One optimizer step over the micro-batches; returns the mean loss (on device)."""
    model.train()
    total = torch.zeros((), device=plan.device)
    for batch in micro_batches:
        if len(batch.labels) == 0:
            continue  # every sample of this micro-batch was a skipped bad file
        images, labels = to_device(batch, plan.device)
        with autocast(plan):
            logits = model(images)
        loss = F.cross_entropy(logits.float(), labels, label_smoothing=plan.label_smoothing)
        (loss / len(micro_batches)).backward()
        total += loss.detach() / len(micro_batches)
    if plan.grad_clip_norm:
        torch.nn.utils.clip_grad_norm_(model.parameters(), plan.grad_clip_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return total


@torch.no_grad()
def evaluate(model: torch.nn.Module, loader: torch.utils.data.DataLoader,
             plan: LoopPlan) -> Dict[str, float]:
    """Mean loss and top-1 over the whole validation split (summed over ranks)."""
    model.eval()
    sums = torch.zeros(3, dtype=torch.float64, device=plan.device)  # loss, correct, count
    for batch in loader:
        if len(batch.labels) == 0:
            continue  # only skipped bad files
        images, labels = to_device(batch, plan.device)
        with autocast(plan):
            logits = model(images).float()
        sums[0] += F.cross_entropy(logits, labels, reduction="sum")
        sums[1] += (logits.argmax(dim=1) == labels).sum()
        sums[2] += labels.numel()
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(sums)
    model.train()
    loss, correct, count = sums.tolist()
    return {"val/loss": loss / count, "val/top1": correct / count}

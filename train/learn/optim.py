"""Optimizer and learning-rate schedule."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from train.config import OptimConfig, OptimizerName, SchedulerConfig, SchedulerName
from train.errors import ConfigError


def build_optimizer(cfg: OptimConfig, model: torch.nn.Module) -> torch.optim.Optimizer:
    # Weight decay on norm layers and biases only hurts; the usual split keeps them free.
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim > 1]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.ndim <= 1]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    if cfg.name == OptimizerName.sgd:
        if cfg.nesterov and cfg.momentum == 0:  # torch's ValueError would be "unexpected"
            raise ConfigError("optim.nesterov=true needs optim.momentum > 0: set "
                              "optim.nesterov=false, or a momentum")
        return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum, nesterov=cfg.nesterov)
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas))


@dataclass(frozen=True)
class LrSchedule:
    """lr multiplier at optimizer step `step`: linear warmup, then cosine / step / constant.

    A picklable callable rather than a lambda, so the scheduler's state is plain data.
    """

    name: SchedulerName
    warmup_steps: int
    total_steps: int
    steps_per_epoch: int
    min_lr_ratio: float = 0.0
    step_epochs: int = 1
    gamma: float = 0.1

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if self.name == SchedulerName.cosine:
            span = max(self.total_steps - self.warmup_steps, 1)
            progress = min((step - self.warmup_steps) / span, 1.0)
            cosine = 0.5 * (1 + math.cos(math.pi * progress))
            return self.min_lr_ratio + (1 - self.min_lr_ratio) * cosine
        if self.name == SchedulerName.step:
            return self.gamma ** (step // (self.step_epochs * self.steps_per_epoch))
        return 1.0


def build_scheduler(cfg: SchedulerConfig, optimizer: torch.optim.Optimizer, total_steps: int,
                    steps_per_epoch: int) -> torch.optim.lr_scheduler.LambdaLR:
    schedule = LrSchedule(SchedulerName(cfg.name), cfg.warmup_steps, total_steps,
                          steps_per_epoch, cfg.min_lr_ratio, cfg.step_epochs, cfg.gamma)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)

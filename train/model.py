"""Models: any torchvision classification model by name, trained from scratch."""

from __future__ import annotations

import difflib

import torch
import torch.nn.functional as F
import torchvision

from train.config import ModelConfig
from train.errors import ConfigError


def classification_models() -> list[str]:
    return torchvision.models.list_models(module=torchvision.models)


def build_model(cfg: ModelConfig, num_classes: int) -> torch.nn.Module:
    names = classification_models()
    if cfg.name not in names:
        close = difflib.get_close_matches(cfg.name, names, n=3)
        hint = f" (did you mean {', '.join(close)}?)" if close else ""
        raise ConfigError(
            f"unknown model.name '{cfg.name}'{hint}: valid names are listed by "
            f"python -c 'import torchvision; print(torchvision.models.list_models("
            f"torchvision.models))'")
    model = torchvision.models.get_model(cfg.name, weights=None, num_classes=num_classes)
    if cfg.dropout > 0:
        add_head_dropout(model, cfg.dropout)
    return model


def add_head_dropout(model: torch.nn.Module, p: float) -> None:
    """Dropout on the input of the last linear layer, as a hook: the state dict keeps the
    torchvision layout, so exported weights load into the stock model."""
    head = [m for m in model.modules() if isinstance(m, torch.nn.Linear)][-1]
    head.register_forward_pre_hook(
        lambda module, args: (F.dropout(args[0], p, module.training),))

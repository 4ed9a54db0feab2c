"""Models: any torchvision classification model by name, trained from scratch."""

from __future__ import annotations

import difflib

import torch
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
    return torchvision.models.get_model(cfg.name, weights=None, num_classes=num_classes)

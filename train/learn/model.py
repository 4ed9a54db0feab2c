"""Models: any torchvision classification model by name, trained from scratch, or one of the
tiny CNNs below (fast enough for multi-process tests on CPU)."""

from __future__ import annotations

import difflib

import torch
import torch.nn.functional as F
import torchvision

from train.config import ModelConfig
from train.errors import ConfigError


class TinyBlock(torch.nn.Module):
    """conv3x3 -> BatchNorm (or nothing) -> ReLU; a unit of its own under strategy=fsdp."""

    def __init__(self, in_channels: int, out_channels: int, stride: int, norm: bool) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(in_channels, out_channels, 3, stride, padding=1,
                                    bias=not norm)
        self.norm = torch.nn.BatchNorm2d(out_channels) if norm else torch.nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.norm(self.conv(x)))


class TinyCNN(torch.nn.Module):
    """Four blocks, global average pooling and a linear classifier: 33,626 parameters for 10
    classes."""

    def __init__(self, num_classes: int, norm: bool = True) -> None:
        super().__init__()
        self.features = torch.nn.Sequential(
            TinyBlock(3, 16, 1, norm), TinyBlock(16, 32, 2, norm),
            TinyBlock(32, 32, 1, norm), TinyBlock(32, 64, 2, norm))
        self.fc = torch.nn.Linear(64, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.features(x).mean(dim=(2, 3)))


TINY_MODELS = {"tiny_cnn": True, "tiny_cnn_nobn": False}  # name -> with BatchNorm


def classification_models() -> list[str]:
    return torchvision.models.list_models(module=torchvision.models)


def build_model(cfg: ModelConfig, num_classes: int) -> torch.nn.Module:
    if cfg.name in TINY_MODELS:
        model: torch.nn.Module = TinyCNN(num_classes, norm=TINY_MODELS[cfg.name])
    else:
        names = classification_models()
        if cfg.name not in names:
            close = difflib.get_close_matches(cfg.name, names + list(TINY_MODELS), n=3)
            hint = f" (did you mean {', '.join(close)}?)" if close else ""
            raise ConfigError(
                f"unknown model.name '{cfg.name}'{hint}: valid names are "
                f"{', '.join(TINY_MODELS)} and those listed by python -c 'import torchvision; "
                f"print(torchvision.models.list_models(torchvision.models))'")
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

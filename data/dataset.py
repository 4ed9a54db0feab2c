"""JPEG image-folder datasets with per-sample deterministic augmentation.

`root/<split>/<class>/*.jpg` is indexed once into a sorted (file, label) list. A sample is
addressed by `(epoch, index)`; its random crop and flip come from a `torch.Generator` seeded by
(seed, epoch, index), never from the global RNG, so the same sample gets the same pixels in
any worker, on any rank, after any restart, and the trainer's own RNG is left untouched.

Batches leave the loader as uint8 (4x fewer bytes to copy to the device); `normalize` turns
them into float on the device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import List, Sequence, Tuple

import torch
from torchvision.io import ImageReadMode, decode_jpeg
from torchvision.transforms.v2 import functional as F

from data.errors import DatasetError
from data.sampler import Key, derive_seed

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".JPG", ".JPEG")


@dataclass(frozen=True)
class FolderIndex:
    root: Path
    classes: List[str]
    files: List[str]  # relative to root, sorted
    labels: List[int]

    def __len__(self) -> int:
        return len(self.files)


def index_folder(root: Path) -> FolderIndex:
    """Sorted (file, label) list of an ImageFolder split directory."""
    root = Path(root)
    if not root.is_dir():
        raise DatasetError(f"data split directory {root} does not exist: set data.root to a "
                           f"folder holding train/<class>/*.jpg and val/<class>/*.jpg")
    classes = sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    if not classes:
        raise DatasetError(f"{root} has no class folders: expected {root}/<class>/*.jpg")
    files, labels = [], []
    for label, name in enumerate(classes):
        found = sorted(p.name for p in (root / name).iterdir() if p.suffix in IMAGE_SUFFIXES)
        if not found:
            raise DatasetError(f"class folder {root / name} holds no .jpg files: add images "
                               f"or remove the folder")
        files += [f"{name}/{f}" for f in found]
        labels += [label] * len(found)
    return FolderIndex(root, classes, files, labels)


def random_resized_crop_box(height: int, width: int, generator: torch.Generator,
                            scale: Tuple[float, float] = (0.08, 1.0),
                            ratio: Tuple[float, float] = (3 / 4, 4 / 3)
                            ) -> Tuple[int, int, int, int]:
    """torchvision's RandomResizedCrop box (top, left, h, w), drawn from `generator`."""
    area = height * width
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(10):
        u = torch.rand(3, generator=generator).tolist()
        target_area = area * (scale[0] + (scale[1] - scale[0]) * u[0])
        aspect = math.exp(log_ratio[0] + (log_ratio[1] - log_ratio[0]) * u[1])
        w = int(round(math.sqrt(target_area * aspect)))
        h = int(round(math.sqrt(target_area / aspect)))
        if 0 < w <= width and 0 < h <= height:
            top = int(torch.randint(0, height - h + 1, (1,), generator=generator))
            left = int(torch.randint(0, width - w + 1, (1,), generator=generator))
            return top, left, h, w
    # Fallback, as torchvision: the whole image, cropped to the nearest allowed ratio.
    in_ratio = width / height
    if in_ratio < ratio[0]:
        w, h = width, int(round(width / ratio[0]))
    elif in_ratio > ratio[1]:
        h, w = height, int(round(height * ratio[1]))
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w


class JpegFolderDataset(torch.utils.data.Dataset):
    """Map-style dataset over a `FolderIndex`; items are (uint8 CHW image, label, index)."""

    def __init__(self, index: FolderIndex, image_size: int, train: bool, seed: int,
                 crop_scale_min: float = 0.35) -> None:
        self.index, self.image_size, self.train = index, image_size, train
        self.seed, self.crop_scale = seed, (crop_scale_min, 1.0)

    def __len__(self) -> int:
        return len(self.index)

    @property
    def num_classes(self) -> int:
        return len(self.index.classes)

    def read_bytes(self, i: int) -> bytes:
        return (self.index.root / self.index.files[i]).read_bytes()

    def __getitem__(self, key: Key) -> Tuple[torch.Tensor, int, int]:
        epoch, i = key
        data = torch.frombuffer(bytearray(self.read_bytes(i)), dtype=torch.uint8)
        image = decode_jpeg(data, mode=ImageReadMode.RGB)
        if self.train:
            image = self.augment(image, epoch, i)
        else:
            image = self.center(image)
        return image, self.index.labels[i], i

    def augment(self, image: torch.Tensor, epoch: int, i: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(derive_seed(self.seed, epoch, i))
        top, left, h, w = random_resized_crop_box(image.shape[-2], image.shape[-1], generator,
                                                  scale=self.crop_scale)
        size = [self.image_size, self.image_size]
        image = F.resized_crop(image, top, left, h, w, size, antialias=True)
        if torch.rand(1, generator=generator).item() < 0.5:
            image = F.horizontal_flip(image)
        return image

    def center(self, image: torch.Tensor) -> torch.Tensor:
        # The usual eval recipe: resize the short side to size/0.875, take the centre.
        image = F.resize(image, [int(self.image_size / 0.875)], antialias=True)
        return F.center_crop(image, [self.image_size, self.image_size])


def normalize(images: torch.Tensor, mean: Sequence[float] = IMAGENET_MEAN,
              std: Sequence[float] = IMAGENET_STD) -> torch.Tensor:
    """uint8 NCHW -> normalized float, on whatever device the batch is on."""
    m = torch.tensor(mean, device=images.device).view(1, -1, 1, 1) * 255
    s = torch.tensor(std, device=images.device).view(1, -1, 1, 1) * 255
    return (images.float() - m) / s

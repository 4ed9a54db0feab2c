"""Image-folder datasets over a volume and a node cache, with per-sample deterministic
augmentation.

A sample is addressed by `(epoch, index)`; its bytes come from the node cache (or straight
from the volume when there is none), and its random crop and flip from a `torch.Generator`
seeded by (seed, epoch, index), never from the global RNG, so the same sample gets the same
pixels in any worker, on any rank, after any restart, and the trainer's own RNG is left alone.

A file that is not a usable image (corrupt, truncated, not an image, larger than
`max_pixels`, gone, unreadable; see `data.decode`) is a *bad file*: with `on_bad_file="skip"`
its sample is left out of its batch with a warning and counted, deterministically (it is bad
in every epoch, on every rank), so exact-once holds over the readable samples and a resume
stays exact; with `"fail"` it ends the run with one line.

Batches leave the loader as uint8 (4x fewer bytes to copy to the device); `normalize` turns
them into float on the device.
"""

from __future__ import annotations

import logging
import math
from typing import NamedTuple, Optional, Sequence, Set, Tuple, Union

import torch
from torchvision.transforms.v2 import functional as F

from data.cache import Lookup, NodeCache, cache_key
from data.decode import (DEFAULT_MAX_PIXELS, NOT_AN_IMAGE, BadImageError, decode,
                         looks_like_an_image)
from data.errors import DatasetError, OnBadFile
from data.index import DatasetIndex
from data.sampler import Key, derive_seed
from data.volume import BadFileError, Volume

log = logging.getLogger(__name__)

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


class Sample(NamedTuple):
    image: Optional[torch.Tensor]  # uint8 CHW; None for a skipped bad file
    label: int
    index: int
    lookup: Lookup


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
    """Map-style dataset over a `DatasetIndex`; items are `Sample`s (see `data.loader`)."""

    def __init__(self, index: DatasetIndex, volume: Volume, cache: Optional[NodeCache],
                 image_size: int, train: bool, seed: int, crop_scale_min: float = 0.35,
                 on_bad_file: OnBadFile = OnBadFile.skip,
                 max_pixels: int = DEFAULT_MAX_PIXELS) -> None:
        self.index, self.volume, self.cache = index, volume, cache
        self.max_pixels = max_pixels
        self.image_size, self.train = image_size, train
        self.seed, self.crop_scale = seed, (crop_scale_min, 1.0)
        self.on_bad_file = OnBadFile(on_bad_file)
        self._warned: Set[int] = set()

    def __len__(self) -> int:
        return len(self.index)

    @property
    def num_classes(self) -> int:
        return len(self.index.classes)

    def key(self, i: int) -> str:
        return cache_key(self.volume.url_of(self.index.name(i)), int(self.index.sizes[i]))

    def fetch(self, i: int) -> bytes:
        """Sample i's bytes from the volume; BadFileError when it cannot be read or is no
        image. Every fill of the cache comes through here, so a file that is not an image
        (a hostile dataset's link to a key or a password file) is never written anywhere."""
        data = self.volume.read(self.index.name(i))
        if not looks_like_an_image(data):
            raise BadFileError(NOT_AN_IMAGE)
        return data

    def read_bytes(self, i: int) -> Tuple[Union[bytes, bytearray], Lookup]:
        if self.cache is None:
            data = self.fetch(i)
            return data, Lookup(False, len(data))
        return self.cache.get(self.key(i), lambda: self.fetch(i))

    def __getitem__(self, key: Key) -> Sample:
        epoch, i = key
        label = int(self.index.labels[i])
        try:
            data, lookup = self.read_bytes(i)
        except BadFileError as err:
            return self.bad_file(i, label, str(err), Lookup(False, 0))
        try:
            image = decode(data, self.max_pixels)
            image = self.augment(image, epoch, i) if self.train else self.center(image)
        except BadImageError as err:
            return self.bad_file(i, label, str(err), lookup)
        return Sample(image, label, i, lookup)

    def bad_file(self, i: int, label: int, problem: str, lookup: Lookup) -> Sample:
        """The placeholder the collate function leaves out (or, with `fail`, the end)."""
        path = self.volume.path(self.index.name(i))
        if self.on_bad_file == OnBadFile.fail:
            raise DatasetError(f"{path}: {problem}: remove or replace the file, or set "
                               f"data.on_bad_file=skip to train without it")
        if i not in self._warned:  # once per file and process, not once per epoch
            self._warned.add(i)
            log.warning("skipping %s: %s (data.on_bad_file=skip; skipped in every epoch)",
                        path, problem)
        return Sample(None, label, i, lookup)

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
        """The usual eval recipe: resize the short side to size/0.875, take the centre.
        The resize allocates the whole resized image, so its size is checked first
        (BadImageError past `max_pixels`)."""
        short_side = int(self.image_size / 0.875)
        height, width = image.shape[-2:]
        # torchvision's own rounding of the long side.
        resized = short_side * int(short_side * max(height, width) / min(height, width))
        if resized > self.max_pixels:
            raise BadImageError(f"resizing its {width}x{height} pixels to a short side of "
                                f"{short_side} would make {resized} pixels, more than "
                                f"data.max_image_pixels={self.max_pixels}")
        image = F.resize(image, [short_side], antialias=True)
        return F.center_crop(image, [self.image_size, self.image_size])


def normalize(images: torch.Tensor, mean: Sequence[float] = IMAGENET_MEAN,
              std: Sequence[float] = IMAGENET_STD) -> torch.Tensor:
    """uint8 NCHW -> normalized float, on whatever device the batch is on."""
    m = torch.tensor(mean, device=images.device).view(1, -1, 1, 1) * 255
    s = torch.tensor(std, device=images.device).view(1, -1, 1, 1) * 255
    return (images.float() - m) / s

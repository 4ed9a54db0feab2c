"""The dataset index: the sorted (file, label) list of an ImageFolder split, built once.

Listing a large bucket is slow and costs money, so the listing happens once and the result is
stored under the cache directory (`index/<hash of the split URL>.npz`) and reused by later runs
and by every rank and worker. In memory it is a few numpy arrays (all names in one byte
buffer plus offsets), not Python lists of strings: forked DataLoader workers share those pages
instead of copying them as reference counts change. `digest` (a hash of names, labels and
sizes) identifies the dataset.
"""

from __future__ import annotations

import hashlib
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional

import numpy as np

from data.errors import DatasetError
from data.volume import Volume

log = logging.getLogger(__name__)

IMAGE_SUFFIXES = (".jpg", ".jpeg")


@dataclass(frozen=True)
class DatasetIndex:
    url: str  # the split's root: the volume URL plus "/train" or "/val"
    classes: List[str]
    names: np.ndarray  # uint8: every "split/class/file.jpg" (relative to the volume), joined
    offsets: np.ndarray  # int64, len + 1: name i is names[offsets[i]:offsets[i + 1]]
    labels: np.ndarray  # int32
    sizes: np.ndarray  # int64 bytes; -1 where the store does not say (HTTP listings)

    def __len__(self) -> int:
        return len(self.labels)

    def name(self, i: int) -> str:
        return self.names[self.offsets[i]:self.offsets[i + 1]].tobytes().decode()

    @property
    def digest(self) -> str:
        h = hashlib.sha256()
        for part in (self.names, self.offsets, self.labels, self.sizes):
            h.update(np.ascontiguousarray(part).tobytes())
        h.update("\n".join(self.classes).encode())
        return h.hexdigest()[:16]

    def save(self, path: Path) -> None:
        """Atomically (temporary file + rename), so a reader never sees half an index."""
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        try:
            with open(tmp, "wb") as f:
                np.savez(f, url=np.array(self.url), classes=np.array(self.classes, dtype=str),
                         names=self.names, offsets=self.offsets, labels=self.labels,
                         sizes=self.sizes)
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)

    @classmethod
    def load(cls, path: Path) -> "DatasetIndex":
        with np.load(path, allow_pickle=False) as z:
            return cls(str(z["url"]), [str(c) for c in z["classes"]], z["names"],
                       z["offsets"], z["labels"], z["sizes"])


def list_split(volume: Volume, split: str) -> DatasetIndex:
    """List `<root>/<split>/<class>/*.jpg`: one listing of the split, one per class folder."""
    classes = [e["name"] for e in volume.list_dir(split)
               if e["type"] == "directory" and not e["name"].startswith(".")]
    if not classes:
        raise DatasetError(f"{volume.path(split)} has no class folders: expected "
                           f"{volume.path(split)}/<class>/*.jpg")
    names: List[bytes] = []
    labels: List[int] = []
    sizes: List[int] = []
    for label, cls in enumerate(classes):
        files = [e for e in volume.list_dir(f"{split}/{cls}")
                 if e["type"] == "file" and e["name"].lower().endswith(IMAGE_SUFFIXES)]
        if not files:
            raise DatasetError(f"class folder {volume.path(f'{split}/{cls}')} holds no .jpg "
                               f"files: add images or remove the folder")
        names += [f"{split}/{cls}/{e['name']}".encode() for e in files]
        labels += [label] * len(files)
        sizes += [-1 if e["size"] is None else int(e["size"]) for e in files]
    offsets = np.zeros(len(names) + 1, dtype=np.int64)
    np.cumsum([len(n) for n in names], out=offsets[1:])
    return DatasetIndex(volume.path(split), classes,
                        np.frombuffer(b"".join(names), dtype=np.uint8).copy(), offsets,
                        np.asarray(labels, dtype=np.int32), np.asarray(sizes, dtype=np.int64))


def load_or_build(volume: Volume, split: str, store_dir: Optional[Path],
                  rebuild: bool = False) -> DatasetIndex:
    """The split's index: from `store_dir` when stored there before, else listed and stored."""
    url = volume.path(split)
    path = None
    if store_dir is not None:
        path = Path(store_dir) / f"{hashlib.sha256(url.encode()).hexdigest()[:16]}.npz"
        if path.is_file() and not rebuild:
            try:
                index = DatasetIndex.load(path)
                if index.url == url:
                    return index
            except (OSError, ValueError, KeyError) as err:
                log.warning("stored index %s is unreadable (%s): listing again", path, err)
    index = list_split(volume, split)
    log.info("indexed %s: %d files in %d classes (index %s)", url, len(index),
             len(index.classes), index.digest)
    if path is not None:
        try:
            index.save(path)
        except OSError as err:
            log.warning("cannot store the index at %s (%s): the next run lists %s again; "
                        "free space under data.cache_dir", path, err.strerror, url)
    return index

"""The dataset index: the sorted (file, label) list of an ImageFolder split, built once.

Listing a large bucket is slow and costs money, so the listing happens once and the result is
stored under the cache directory (`index/<hash of the split URL>-v<format>.npz`) and reused
by later runs and by every rank and worker. In memory it is a few numpy arrays (all names in one byte
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
from collections import Counter
from typing import Any, Dict, List, Optional

import numpy as np

from common.files import atomic_file
from data.decode import IMAGE_SUFFIXES
from data.errors import DatasetError
from common.redact import strip_credentials
from data.volume import Volume

log = logging.getLogger(__name__)

# Bump when the listing rules change, so an index listed under older rules is not reused.
INDEX_FORMAT = 2
MAX_REASONS_SHOWN = 6


@dataclass(frozen=True)
class DatasetIndex:
    url: str  # the split's root: the volume URL plus "/train" or "/val"
    classes: List[str]
    names: np.ndarray  # uint8: every "split/class/file.jpg" (relative to the volume), joined
    offsets: np.ndarray  # int64, len + 1: name i is names[offsets[i]:offsets[i + 1]]
    labels: np.ndarray  # int32
    sizes: np.ndarray  # int64 bytes; -1 where the store does not say (HTTP listings)
    left_out: str = ""  # what the listing found that is not a sample, and why (counts only)

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
        with atomic_file(path) as f:
            np.savez(f, url=np.array(self.url), classes=np.array(self.classes, dtype=str),
                     names=self.names, offsets=self.offsets, labels=self.labels,
                     sizes=self.sizes, left_out=np.array(self.left_out))

    @classmethod
    def load(cls, path: Path) -> "DatasetIndex":
        with np.load(path, allow_pickle=False) as z:
            return cls(str(z["url"]), [str(c) for c in z["classes"]], z["names"],
                       z["offsets"], z["labels"], z["sizes"], str(z["left_out"]))


def left_out_reason(entry: Dict[str, Any]) -> Optional[str]:
    """Why a class folder's entry (from `Volume.list_dir`) is not a sample; None if it is.
    Image files are chosen by name here, as ImageFolder does; their format is told by content
    when they are decoded."""
    if entry["type"] == "broken":
        return "broken links"
    if entry["type"] == "directory":
        return "subfolders"
    if entry["type"] != "file":
        return "not regular files"
    name = entry["name"]
    suffix = os.path.splitext(name)[1].lower() or (name if name.startswith(".") else "no suffix")
    return None if suffix in IMAGE_SUFFIXES else suffix


def describe_left_out(reasons: Counter) -> str:
    """'3 entries that are not images (.txt: 2, .DS_Store: 1)', most common reason first."""
    shown = reasons.most_common(MAX_REASONS_SHOWN)
    more = len(reasons) - len(shown)
    parts = [f"{reason}: {count}" for reason, count in shown] + ([f"{more} more"] if more else [])
    return f"{sum(reasons.values())} entries that are not images ({', '.join(parts)})"


def list_split(volume: Volume, split: str) -> DatasetIndex:
    """List `<root>/<split>/<class>/<image>`: one listing of the split, one per class folder.
    Symlinks are followed; what is not an image is counted in `left_out`, by reason."""
    classes: List[str] = []
    left_out: Counter = Counter()
    for entry in volume.list_dir(split):
        if entry["type"] == "directory":
            if not entry["name"].startswith("."):
                classes.append(entry["name"])
        elif entry["type"] == "broken":  # a class folder that vanished behind a dead link
            left_out["broken links"] += 1
        else:
            left_out["files outside class folders"] += 1
    if not classes:
        raise DatasetError(f"{volume.path(split)} has no class folders: expected "
                           f"{volume.path(split)}/<class>/*.jpg")
    names: List[bytes] = []
    labels: List[int] = []
    sizes: List[int] = []
    for label, cls in enumerate(classes):
        files = []
        skipped: Counter = Counter()
        for entry in volume.list_dir(f"{split}/{cls}"):
            reason = left_out_reason(entry)
            if reason is None:
                files.append(entry)
            else:
                skipped[reason] += 1
        if not files:
            found = f"left out {describe_left_out(skipped)}" if skipped else "it is empty"
            raise DatasetError(f"class folder {volume.path(f'{split}/{cls}')} holds no images "
                               f"({found}; images are {' '.join(IMAGE_SUFFIXES)}): add "
                               f"images or remove the folder")
        left_out.update(skipped)
        names += [f"{split}/{cls}/{e['name']}".encode() for e in files]
        labels += [label] * len(files)
        sizes += [-1 if e["size"] is None else int(e["size"]) for e in files]
    offsets = np.zeros(len(names) + 1, dtype=np.int64)
    np.cumsum([len(n) for n in names], out=offsets[1:])
    # Stored under the cache directory: a URL's credentials stay out of it.
    return DatasetIndex(strip_credentials(volume.url_of(split)), classes,
                        np.frombuffer(b"".join(names), dtype=np.uint8).copy(), offsets,
                        np.asarray(labels, dtype=np.int32), np.asarray(sizes, dtype=np.int64),
                        describe_left_out(left_out) if left_out else "")


def load_or_build(volume: Volume, split: str, store_dir: Optional[Path],
                  rebuild: bool = False) -> DatasetIndex:
    """The split's index: from `store_dir` when stored there before, else listed and stored."""
    url = strip_credentials(volume.url_of(split))
    path = None
    if store_dir is not None:
        name = f"{hashlib.sha256(url.encode()).hexdigest()[:16]}-v{INDEX_FORMAT}.npz"
        path = Path(store_dir) / name
        if path.is_file() and not rebuild:
            try:
                index = DatasetIndex.load(path)
                if index.url == url:
                    warn_left_out(index)
                    return index
            except (OSError, ValueError, KeyError) as err:
                log.warning("stored index %s is unreadable (%s): listing again", path, err)
    index = list_split(volume, split)
    log.info("indexed %s: %d files in %d classes (index %s)", url, len(index),
             len(index.classes), index.digest)
    warn_left_out(index)
    if path is not None:
        try:
            index.save(path)
        except OSError as err:
            log.warning("cannot store the index at %s (%s): the next run lists %s again; "
                        "free space under data.cache_dir", path, err.strerror, url)
    return index


def warn_left_out(index: DatasetIndex) -> None:
    """One warning line per split, on every run (the stored index keeps the counts): a tree
    whose files are half `.gif` must not train on the other half in silence."""
    if index.left_out:
        log.warning("%s: left out %s; ImageFolder's image suffixes are %s", index.url,
                    index.left_out, " ".join(IMAGE_SUFFIXES))

"""From the `data` config to datasets and loaders: what `python -m train` calls.

The volume is `data.root` (a folder or an fsspec URL); the node cache is `data.cache_dir`
(null: no cache, read through), which also stores the indexes, so a restart neither lists
the volume again nor fetches a cached file twice. A root on local disk is not cached at all
unless `data.cache=always` (data/locality.py tells local from remote).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Iterable, List, Optional, Tuple

from omegaconf import DictConfig, OmegaConf

from data import synthetic
from data.cache import NodeCache
from data.dataset import JpegFolderDataset
from data.decode import DEFAULT_MAX_PIXELS
from data.errors import DatasetError, OnBadFile
from data.index import DatasetIndex, load_or_build
from data.loader import VolumeLoader
from data.locality import CacheUse, locate
from common.progress import task_progress
from common.redact import strip_credentials
from data.sampler import Key
from data.volume import MissingPathError, Volume

log = logging.getLogger(__name__)

GB = 10 ** 9
MAX_CLASSES_NAMED = 5  # in a train/val class mismatch; the rest are counted


def prepare_root(cfg: DictConfig) -> Volume:
    """The dataset's volume; the embedded shapes dataset is generated on first use."""
    if str(cfg.root) == str(cfg.synthetic.dir):
        generate_synthetic(cfg.synthetic)
    volume = Volume(str(cfg.root), cfg.read_retries, cfg.retry_backoff_seconds,
                    OmegaConf.to_container(cfg.storage_options, resolve=True))
    try:
        entries = volume.list_dir("")
    except MissingPathError:
        raise DatasetError(f"data.root {cfg.root} does not exist or is not a directory: "
                           f"point data.root at a folder with train/ and val/ subfolders"
                           ) from None
    if not entries:
        raise DatasetError(f"data.root {cfg.root} is empty: expected train/<class>/*.jpg and "
                           f"val/<class>/*.jpg under it")
    return volume


def generate_synthetic(syn: DictConfig) -> None:
    expected = synthetic.manifest(syn.seed, syn.num_train, syn.num_val, syn.size)
    if synthetic.is_complete(Path(syn.dir), expected):
        return
    log.info("generating the shapes dataset at %s (first use)", syn.dir)
    with task_progress("generating shapes", syn.num_train + syn.num_val, log) as update:
        synthetic.generate(Path(syn.dir), syn.num_train, syn.num_val, syn.size, syn.seed,
                           progress=update)


def open_cache(cfg: DictConfig, cache_dir: Optional[str]) -> Optional[NodeCache]:
    """The node cache for `data.root` in `cache_dir` (this node's `data.cache_dir`), or
    None: with `data.cache=auto` a root on this node's local disk is read in place (copying
    it would only double its disk use)."""
    if cache_dir is None or not wants_cache(CacheUse(cfg.cache), str(cfg.root)):
        return None
    if cfg.cache_limit_gb <= 0:
        raise DatasetError(f"data.cache_limit_gb={cfg.cache_limit_gb} must be > 0: set a byte "
                           f"budget, or data.cache_dir=null to read without a cache")
    warn_unless_local(cache_dir)
    try:
        return NodeCache(Path(cache_dir), int(cfg.cache_limit_gb * GB))
    except OSError as err:
        raise DatasetError(f"cannot use data.cache_dir={cache_dir} ({err.strerror}): "
                           f"point it at a writable local disk, or set data.cache_dir=null"
                           ) from None


def wants_cache(use: CacheUse, root: str) -> bool:
    if use is not CacheUse.auto:
        return use is CacheUse.always
    where = locate(root)
    if where.local:
        log.info("data.root %s is %s: reading it in place, no cache (data.cache=always "
                 "caches it)", strip_credentials(root), where.describe())
    else:
        log.info("data.root %s is %s: caching it (data.cache=never reads it in place)",
                 strip_credentials(root), where.describe())
    return not where.local


def warn_unless_local(cache_dir: str) -> None:
    """The cache pays only on this node's own disk: a home directory on NFS (a cluster's
    usual ~/.cache) is another network volume."""
    where = locate(cache_dir)
    if not where.local:
        log.warning("data.cache_dir=%s is %s: the cache is only as fast as that; point "
                    "data.cache_dir at local disk (NVMe)", cache_dir, where.describe())


def build_datasets(cfg: DictConfig, seed: int, cache_dir: Optional[str]
                   ) -> Tuple[JpegFolderDataset, JpegFolderDataset]:
    """(train, val) datasets over `data.root`, sharing one node cache in `cache_dir` (this
    node's `data.cache_dir`; None: none)."""
    volume = prepare_root(cfg)
    cache = open_cache(cfg, cache_dir)
    common = dict(on_bad_file=cfg.on_bad_file, reindex=cfg.reindex,
                  max_pixels=cfg.max_image_pixels)
    train = open_dataset(volume, "train", cache, cfg.image_size, train=True, seed=seed,
                         crop_scale_min=cfg.crop_scale_min, **common)
    val = open_dataset(volume, "val", cache, cfg.image_size, train=False, seed=seed, **common)
    check_same_classes(train.index, val.index)
    return train, val


def check_same_classes(train: DatasetIndex, val: DatasetIndex) -> None:
    """A label is a class's position in its split's sorted class list, so the lists must be
    equal, or val label k names another class than the model's output k."""
    if train.classes == val.classes:
        return
    problems = []
    for what, names in (("classes with no val folder", set(train.classes) - set(val.classes)),
                        ("val classes not in train", set(val.classes) - set(train.classes))):
        if names:
            shown = sorted(names)[:MAX_CLASSES_NAMED]
            more = f" and {len(names) - len(shown)} more" if len(names) > len(shown) else ""
            problems.append(f"{len(names)} {what} ({', '.join(shown)}{more})")
    raise DatasetError(f"train and val have different classes: {'; '.join(problems)}: give "
                       f"{val.url} the same class folders as {train.url}")


def open_dataset(volume: Volume, split: str, cache: Optional[NodeCache], image_size: int,
                 train: bool, seed: int, crop_scale_min: float = 0.35,
                 on_bad_file: OnBadFile = OnBadFile.skip,
                 reindex: bool = False,
                 max_pixels: int = DEFAULT_MAX_PIXELS) -> JpegFolderDataset:
    """One split; its index is stored in (and reused from) the cache directory."""
    store = cache.root / "index" if cache is not None else None
    return JpegFolderDataset(load_or_build(volume, split, store, reindex), volume, cache,
                             image_size, train, seed, crop_scale_min, on_bad_file, max_pixels)


def build_loader(dataset: JpegFolderDataset, batches: Iterable[List[Key]], cfg: DictConfig,
                 pin_memory: bool) -> VolumeLoader:
    return VolumeLoader(dataset, batches, cfg.num_workers, cfg.prefetch_factor, pin_memory,
                        cfg.prefetch_threads, cfg.prefetch_batches)

"""The DataLoader for this data path, and the prefetcher that keeps the cache ahead of it."""

from __future__ import annotations

import logging
import multiprocessing
import os
import queue
import signal
import sys
import threading
from collections import deque
from typing import Deque, Iterable, Iterator, List, NamedTuple, Optional

import torch
from torch.utils.data import DataLoader

from data.dataset import JpegFolderDataset, Sample
from data.errors import DatasetError
from data.metrics import BAD_FILES, HITS, LOOKUPS, VOLUME_BYTES, DataCounters
from data.sampler import Key
from data.volume import BadFileError

log = logging.getLogger(__name__)


class Batch(NamedTuple):
    images: torch.Tensor  # uint8 NCHW; bad files are left out, so N may be short
    labels: torch.Tensor
    indices: torch.Tensor  # dataset indices of the samples in the batch
    stats: torch.Tensor  # int64 [lookups, hits, volume bytes, bad files] (data.metrics)


def collate_samples(samples: List[Sample]) -> Batch:
    good = [s for s in samples if s.image is not None]
    stats = torch.zeros(4, dtype=torch.int64)
    stats[LOOKUPS] = len(samples)
    stats[HITS] = sum(s.lookup.hit for s in samples)
    stats[VOLUME_BYTES] = sum(s.lookup.volume_bytes for s in samples)
    stats[BAD_FILES] = len(samples) - len(good)
    if not good:
        return Batch(torch.zeros(0, dtype=torch.uint8), torch.zeros(0, dtype=torch.int64),
                     torch.zeros(0, dtype=torch.int64), stats)
    return Batch(torch.stack([s.image for s in good]),
                 torch.tensor([s.label for s in good], dtype=torch.int64),
                 torch.tensor([s.index for s in good], dtype=torch.int64), stats)


class PrefetchingBatches(torch.utils.data.Sampler[List[Key]]):
    """Passes batches of keys through unchanged, and meanwhile has `threads` threads fetch
    the files of the next `lookahead` batches into the node cache (in order).

    The DataLoader draws keys only as it dispatches work, so the look-ahead is bounded: at
    most `lookahead` batches beyond what the workers were given.
    """

    def __init__(self, batches: Iterable[List[Key]], dataset: JpegFolderDataset,
                 counters: DataCounters, threads: int, lookahead: int) -> None:
        self.batches, self.dataset, self.counters = batches, dataset, counters
        self.threads, self.lookahead = threads, lookahead

    def __iter__(self) -> Iterator[List[Key]]:
        # A generator: the threads start at the first draw, after the workers have forked.
        # Plain daemon threads, not concurrent.futures: its exit hook joins every pool thread
        # it knows of, in DataLoader workers forked later too, which then hung at exit.
        upcoming = iter(self.batches)
        ahead: Deque[List[Key]] = deque()
        todo: "queue.SimpleQueue[Optional[int]]" = queue.SimpleQueue()
        for k in range(self.threads):
            threading.Thread(target=self._drain, args=(todo,), name=f"prefetch-{k}",
                             daemon=True).start()
        try:
            while True:
                while len(ahead) <= self.lookahead:
                    batch = next(upcoming, None)
                    if batch is None:
                        break
                    ahead.append(batch)
                    for _, i in batch:
                        todo.put(i)
                if not ahead:
                    return
                yield ahead.popleft()
        finally:
            while not todo.empty():  # cancel what is not started
                todo.get_nowait()
            for _ in range(self.threads):
                todo.put(None)

    def _drain(self, todo: "queue.SimpleQueue[Optional[int]]") -> None:
        while (i := todo.get()) is not None:
            self._warm(i)

    def _warm(self, i: int) -> None:
        try:
            self.counters.add(volume_bytes=self.dataset.cache.ensure(
                self.dataset.key(i), lambda: self.dataset.fetch(i)))
        except (BadFileError, DatasetError):
            pass  # the worker that decodes it reports it, in order and deterministically
        except Exception:  # a prefetch is only a hint: never let it kill the thread pool
            log.exception("prefetch of sample %d failed", i)


def default_num_workers(local_world_size: int = 1) -> int:
    """Decode is CPU-bound: one worker per core this rank may use, at most 8."""
    cores = len(os.sched_getaffinity(0)) // max(local_world_size, 1)
    return max(1, min(8, cores))


class VolumeLoader(DataLoader):
    """A DataLoader tuned for JPEGs on a slow volume behind a node cache.

    - `num_workers`: decode runs in worker processes (`default_num_workers()` if None).
    - persistent workers: the train sampler never ends and eval reuses its workers, so
      nothing is re-forked per epoch (forking re-pays the imports and loses warm state).
    - `prefetch_factor` batches per worker decoded ahead of the loop.
    - `pin_memory`: set on CUDA, so host-to-device copies are asynchronous.
    - prefetch threads (`prefetch_threads`, `prefetch_batches` of look-ahead) fill the cache
      ahead of the workers when the dataset has a cache.
    - `counters`: cache and volume statistics (see `data.metrics`).
    """

    def __init__(self, dataset: JpegFolderDataset, batches: Iterable[List[Key]],
                 num_workers: Optional[int] = None, prefetch_factor: int = 4,
                 pin_memory: bool = False, prefetch_threads: int = 16,
                 prefetch_batches: int = 8) -> None:
        self.counters = DataCounters()
        if dataset.cache is not None and prefetch_threads > 0:
            batches = PrefetchingBatches(batches, dataset, self.counters, prefetch_threads,
                                         prefetch_batches)
        workers = default_num_workers() if num_workers is None else num_workers
        extra = {}
        if workers > 0:
            extra = {"persistent_workers": True, "prefetch_factor": prefetch_factor,
                     "multiprocessing_context": worker_start_method()}
        # Its own generator: the base seed DataLoader draws for workers at every iter() must
        # not come from the global RNG, or resuming (which restores it) would shift it.
        super().__init__(dataset, batch_sampler=batches, num_workers=workers,
                         collate_fn=collate_samples, pin_memory=pin_memory,
                         worker_init_fn=leave_the_process_group,
                         generator=torch.Generator().manual_seed(0), **extra)


def worker_start_method() -> multiprocessing.context.BaseContext:
    """The platform's own start method, whatever this process's default says: fork on Linux
    (the workers share the parent's index arrays, data/index.py), spawn elsewhere (fork is
    unsafe on macOS). Left to the default, a launcher decides: joblib's loky workers make
    "loky" the default, whose processes DataLoader cannot start ("'Process' object has no
    attribute 'env'"); Python 3.14 makes it forkserver on Linux."""
    return multiprocessing.get_context("fork" if sys.platform.startswith("linux") else "spawn")


def leave_the_process_group(worker_id: int) -> None:
    """torchrun signals a rank's whole process group (SIGTERM, on preemption), a terminal
    its foreground group (Ctrl-C): a worker that died of it would fail the loader in the
    middle of the step the main process finishes before it saves. In a group of its own a
    worker hears neither; it ends when the loader shuts it down, or by itself once its parent
    is gone. The parent's signal handlers, inherited through fork, go back to the defaults
    that multiprocessing's own shutdown (SIGTERM) relies on; the other signals that ask the
    trainer to stop (a lost terminal, a time limit's warning, which SLURM sends to every
    process of a step) are the main process's to act on, so a worker ignores them."""
    os.setpgid(0, 0)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for name in ("SIGHUP", "SIGUSR1", "SIGUSR2"):
        signal.signal(getattr(signal, name), signal.SIG_IGN)


def eval_batches(dataset_size: int, batch_size: int, rank: int = 0,
                 world_size: int = 1) -> List[List[Key]]:
    """Every sample once, in order; rank r takes indices r, r+W, ... (eval has no epochs)."""
    mine = list(range(rank, dataset_size, world_size))
    return [[(0, i) for i in mine[s:s + batch_size]] for s in range(0, len(mine), batch_size)]

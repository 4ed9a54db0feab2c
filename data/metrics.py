"""Data-path counters: cache hits, bytes off the volume, bad files.

DataLoader workers are separate processes, so what they count travels back inside each batch
(`Batch.stats`, summed by the collate function); the prefetch threads of the main process add
theirs directly. The loop feeds the batches it consumes to `record_batches` and logs
`data_metrics` every log window.
"""

from __future__ import annotations

import threading
from typing import Dict, Iterable

import torch

# Positions in Batch.stats.
LOOKUPS, HITS, VOLUME_BYTES, BAD_FILES = range(4)


class DataCounters:
    """Thread-safe totals; `window_metrics` reports and restarts the per-window part."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.lookups = self.hits = self.volume_bytes = self.bad_files = 0
        self._window_lookups = self._window_hits = 0

    def add(self, lookups: int = 0, hits: int = 0, volume_bytes: int = 0,
            bad_files: int = 0) -> None:
        with self._lock:
            self.lookups += lookups
            self.hits += hits
            self.volume_bytes += volume_bytes
            self.bad_files += bad_files
            self._window_lookups += lookups
            self._window_hits += hits

    def add_stats(self, stats: torch.Tensor) -> None:
        s = stats.tolist()
        self.add(s[LOOKUPS], s[HITS], s[VOLUME_BYTES], s[BAD_FILES])

    def window_metrics(self) -> Dict[str, float]:
        """Hit ratio over the window (1.0 when nothing was read); byte and bad-file totals."""
        with self._lock:
            ratio = self._window_hits / self._window_lookups if self._window_lookups else 1.0
            self._window_lookups = self._window_hits = 0
            return {"data/cache_hit_ratio": ratio,
                    "data/volume_bytes": float(self.volume_bytes),
                    "data/bad_files": float(self.bad_files)}


def record_batches(loader: Iterable, batches: Iterable) -> None:
    """Count the consumed batches' stats into the loader's counters (if it keeps any)."""
    counters = getattr(loader, "counters", None)
    if counters is not None:
        for batch in batches:
            counters.add_stats(batch.stats)


def data_metrics(loader: Iterable) -> Dict[str, float]:
    counters = getattr(loader, "counters", None)
    return counters.window_metrics() if counters is not None else {}

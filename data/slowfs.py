"""`slow://PATH`: a local folder that behaves like a remote volume, for benchmarks and tests.

Every file read waits a fixed latency and is capped in bandwidth, so a cache and a prefetcher
can be measured against a network without one. Settings come from the environment (so
DataLoader workers and `python -m train` subprocesses inherit them), never from config:

    GOODPUT_SLOWFS_LATENCY_MS   per-file latency (default 20)
    GOODPUT_SLOWFS_MBPS         bandwidth cap per read, MB/s (default 50; 0 = none)
    GOODPUT_SLOWFS_LOG          append one line "<path>\\n" per file read (O_APPEND)
    GOODPUT_SLOWFS_FAIL_FIRST   fail the first N reads of each file (per process) with a
                                transient ConnectionResetError: fault injection
"""

from __future__ import annotations

import os
import time
from collections import Counter
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

PROTOCOL = "slow"


class SlowFileSystem(LocalFileSystem):
    protocol = PROTOCOL
    # One instance per process is enough, and fsspec caches it; failures are counted per file.
    _failures: Counter = Counter()

    @classmethod
    def _strip_protocol(cls, path: str) -> str:
        if isinstance(path, str) and path.startswith(f"{PROTOCOL}://"):
            path = path[len(PROTOCOL) + 3:]
        return super()._strip_protocol(path)

    def cat_file(self, path: str, start: Any = None, end: Any = None, **kwargs: Any) -> bytes:
        path = self._strip_protocol(path)
        fail_first = int(os.environ.get("GOODPUT_SLOWFS_FAIL_FIRST", "0"))
        if self._failures[path] < fail_first:
            self._failures[path] += 1
            raise ConnectionResetError(f"injected transient failure reading {path}")
        start_time = time.perf_counter()
        data = super().cat_file(path, start, end, **kwargs)
        log = os.environ.get("GOODPUT_SLOWFS_LOG")
        if log:
            fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, f"{path}\n".encode())
            finally:
                os.close(fd)
        mbps = float(os.environ.get("GOODPUT_SLOWFS_MBPS", "50"))
        delay = float(os.environ.get("GOODPUT_SLOWFS_LATENCY_MS", "20")) / 1000
        if mbps > 0:
            delay += len(data) / (mbps * 1e6)
        remaining = delay - (time.perf_counter() - start_time)
        if remaining > 0:
            time.sleep(remaining)
        return data


fsspec.register_implementation(PROTOCOL, SlowFileSystem, clobber=True)

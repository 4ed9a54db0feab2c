"""A node-wide file cache on local disk, shared by every rank and worker process of a node.

Layout under `cache_dir`:

    objects/<k[:2]>/<k>   cached files: the payload, then a footer (magic, length, crc32)
    locks/<k[:3]>         fetch locks (4096 stripes), so one process fetches, others wait
    state.lock, usage     the byte ledger of everything in objects/, guarded by a file lock
    index/                each split's stored listing (data/index.py)

Runs share a cache too (`default_cache_dir()`): a file is keyed by its URL, protocol
included, and its size, and a split's index by its URL, so two datasets or two stores never
share an entry, and the budget and the eviction span every dataset in the directory.

The bookkeeping lives on disk because the readers are separate processes. A file is fetched
from the volume at most once per node: a reader that misses takes the key's lock, looks
again, and only then fetches. A fill is a write to a temporary name and a rename, and every
read checks the footer, so a partial or corrupt file is never served (it is dropped and
fetched again). `limit_bytes` is a hard budget: space is reserved in the ledger before a
file is written, evicting least-recently-used files (by mtime, which hits refresh, to the minute).
When the disk itself is full, the cache evicts, retries once, then reads through.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import logging
import math
import os
import struct
import tempfile
import threading
import time
import zlib
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, List, Optional, Sequence, Set, Tuple, Union

from common.processes import pid_alive

log = logging.getLogger(__name__)

FOOTER = struct.Struct("<8sQI")  # magic, payload length, crc32 of the payload
MAGIC = b"GPCACHE1"
LOW_WATERMARK = 0.9  # eviction frees down to this fraction of the limit, to amortize scans
LRU_CLOCK_SECONDS = 60  # a hit refreshes a file's mtime when it is older than this


@dataclass(frozen=True)
class Lookup:
    """How one read was served: from the cache (`hit`), and how many bytes came off the
    volume."""

    hit: bool
    volume_bytes: int


def default_cache_dir() -> str:
    """The node-wide cache that every run of this user shares unless `data.cache_dir` says
    otherwise: `$XDG_CACHE_HOME/goodput-trainer`, else `~/.cache/goodput-trainer` (the XDG
    rule: an empty or relative XDG_CACHE_HOME is ignored); without a home directory, one
    per user under the temporary directory."""
    base = os.environ.get("XDG_CACHE_HOME", "")
    if not os.path.isabs(base):
        home = os.path.expanduser("~")
        if not os.path.isabs(home):  # no HOME and no password entry
            return os.path.join(tempfile.gettempdir(), f"goodput-trainer-{os.getuid()}")
        base = os.path.join(home, ".cache")
    return os.path.join(base, "goodput-trainer")


def cache_key(url: str, size: int) -> str:
    # The size is part of the key, so a file replaced on the volume is not served stale.
    return hashlib.sha1(f"{url}\0{size}".encode()).hexdigest()


class NodeCache:
    """Safe to pickle into DataLoader workers: all shared state is on disk."""

    def __init__(self, root: Path, limit_bytes: int) -> None:
        self.root, self.limit_bytes = Path(root), int(limit_bytes)
        self._warned: Set[str] = set()
        for sub in ("objects", "locks"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        self.reconcile()
        self._warn_if_over_budget()

    def _warn_if_over_budget(self) -> None:
        """Runs sharing the directory with a larger budget filled it: this one's fills
        will evict down to its own budget, the others' files too, and they fetch them again."""
        usage = self.usage_bytes()
        if usage > self.limit_bytes:
            log.warning("cache %s holds %.3g GB, over this run's data.cache_limit_gb=%.3g: its "
                        "fills evict least-recently-used files (other runs' too) down to that; "
                        "give runs that share a cache directory the same data.cache_limit_gb",
                        self.root, usage / 1e9, self.limit_bytes / 1e9)

    def __getstate__(self) -> dict:
        return {"root": self.root, "limit_bytes": self.limit_bytes, "_warned": set()}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)

    # ---- reading -----------------------------------------------------------------------

    def get(self, key: str, fetch: Callable[[], bytes]
            ) -> Tuple[Union[bytes, bytearray], Lookup]:
        """The bytes for `key`: from the cache, else from `fetch()` (once per node)."""
        path = self._object(key)
        data = self._read_valid(path)
        if data is not None:
            return data, Lookup(True, 0)
        with self._lock(self._stripe(key)):
            data = self._read_valid(path)  # another process may have fetched it meanwhile
            if data is not None:
                return data, Lookup(True, 0)
            data = fetch()
            self._store(path, data)
        return data, Lookup(False, len(data))

    def ensure(self, key: str, fetch: Callable[[], bytes]) -> int:
        """Make sure `key` is cached (for prefetching); returns the bytes read from the
        volume."""
        if self._object(key).exists():
            return 0
        with self._lock(self._stripe(key)):
            path = self._object(key)
            if path.exists():
                return 0
            data = fetch()
            self._store(path, data)
        return len(data)

    def _read_valid(self, path: Path) -> Optional[bytearray]:
        """The payload of a complete, verified cache file, or None."""
        try:
            f = open(path, "rb", buffering=0)
        except FileNotFoundError:
            return None
        with f:
            st = os.fstat(f.fileno())
            blob = bytearray(st.st_size)
            got = 0
            while got < len(blob):
                n = f.readinto(memoryview(blob)[got:])
                if not n:
                    break
                got += n
            if st.st_mtime < time.time() - LRU_CLOCK_SECONDS:
                os.utime(f.fileno())  # the LRU clock; coarse, to spare a write per hit
        if got == len(blob) >= FOOTER.size:
            magic, length, crc = FOOTER.unpack_from(blob, len(blob) - FOOTER.size)
            del blob[-FOOTER.size:]  # in place: no copy of the payload
            if magic == MAGIC and length == len(blob) and zlib.crc32(blob) == crc:
                return blob
        log.warning("cache file %s is truncated or corrupt: dropping it and fetching again",
                    path)
        with self._lock(self.root / "state.lock"):
            path.unlink(missing_ok=True)
            self._recount()  # its booked size is unknown now that the file is damaged
        return None

    # ---- writing and the byte budget ----------------------------------------------------

    def _store(self, path: Path, payload: bytes) -> None:
        size = len(payload) + FOOTER.size
        if size > self.limit_bytes:
            return  # larger than the whole budget: read through
        for _ in range(2):
            # The temporary name carries the booked size, so a recount can see reservations.
            tmp = path.with_name(f".tmp-{os.getpid()}-{threading.get_ident()}-{size}-"
                                 f"{path.name}")
            if not self._reserve(size, tmp, self._eviction_candidates(size)):
                return  # the budget is taken by other processes' fills in flight
            try:
                with open(tmp, "r+b") as f:
                    f.write(payload)
                    f.write(FOOTER.pack(MAGIC, len(payload), zlib.crc32(payload)))
                os.replace(tmp, path)
                return
            except FileNotFoundError:
                # Another process's recount removed the fill, and its booking, as a dead
                # one's: a pid alive on another host or in another PID namespace (runs
                # sharing the directory) looks dead there. This read goes on uncached.
                return
            except OSError as err:
                with self._lock(self.root / "state.lock"):
                    tmp.unlink(missing_ok=True)
                    self._add_usage(-size)
                    if err.errno != errno.ENOSPC:
                        raise
                    self._warn_once("cache disk at %s is full before data.cache_limit_gb is "
                                    "reached: evicting least-recently-used files; set "
                                    "data.cache_limit_gb below the disk's free space")
                    self._evict(max(4 * size, self._usage() // 10))
        self._warn_once("cache disk at %s is full even after eviction: reading from the "
                        "volume without caching; free disk space or lower data.cache_limit_gb")

    def _warn_once(self, message: str) -> None:
        # Once per process: a full disk would otherwise log on every sample.
        if message not in self._warned:
            self._warned.add(message)
            log.warning(message, self.root)

    def _eviction_candidates(self, size: int) -> List[Tuple[float, int, Path]]:
        """When `size` more bytes would not fit: every object, least recently used first,
        scanned without the state lock (a million entries take seconds to stat, and every
        fill on the node waits for that lock); [] when they fit."""
        if self._usage() + size <= self.limit_bytes:  # unlocked: a hint, checked again
            return []
        return sorted(self._scan(), key=lambda e: e[0])

    def _reserve(self, size: int, tmp: Path,
                 candidates: Sequence[Tuple[float, int, Path]] = ()) -> bool:
        """Book `size` bytes and create the (empty) fill file `tmp`, in one step under the
        lock, evicting `candidates` in order (and scanning again only when they are not
        enough); False when the bytes do not fit even after eviction."""
        with self._lock(self.root / "state.lock"):
            if self._usage() + size > self.limit_bytes:
                need = self._usage() + size - int(self.limit_bytes * LOW_WATERMARK)
                self._evict(need, candidates)
            if self._usage() + size > self.limit_bytes:
                return False
            tmp.parent.mkdir(exist_ok=True)
            tmp.touch()
            self._add_usage(size)
            return True

    def _evict(self, need: int, candidates: Sequence[Tuple[float, int, Path]] = ()) -> None:
        """Delete least-recently-used objects until `need` bytes are free (lock held): from
        `candidates` (a scan made without the lock), then from a scan of its own if those
        were not enough (another process evicted them meanwhile)."""
        freed = self._remove(candidates, need)
        if freed < need:
            self._remove(sorted(self._scan(), key=lambda e: e[0]), need - freed)

    def _remove(self, entries: Sequence[Tuple[float, int, Path]], need: float = math.inf
                ) -> int:
        """Unlink cached files in order until `need` bytes are freed, then take them off
        the ledger in one write (lock held; a crash in between leaves it counting too
        much, which evicts early until the next process start recounts); the bytes freed."""
        freed = 0
        try:
            for _, _, path in entries:
                if freed >= need:
                    break
                try:
                    size = path.stat().st_size
                    path.unlink()
                except FileNotFoundError:
                    continue  # someone else removed it and its bytes
                freed += size
        finally:
            if freed:
                self._add_usage(-freed)
        return freed

    def _entries(self) -> Iterator[os.DirEntry]:
        for sub in os.scandir(self.root / "objects"):
            if sub.is_dir():
                yield from os.scandir(sub.path)

    def _scan(self) -> Iterator[Tuple[float, int, Path]]:
        """(mtime, size, path) of every finished object."""
        for entry in self._entries():
            if entry.name.startswith(".tmp-"):
                continue
            try:
                st = entry.stat()
            except FileNotFoundError:
                continue
            yield st.st_mtime, st.st_size, Path(entry.path)

    def _recount(self) -> None:
        """Set the ledger to the finished objects plus the live fills' reservations, and
        delete fills whose process died (lock held)."""
        total = sum(size for _, size, _ in self._scan())
        for entry in self._entries():
            if entry.name.startswith(".tmp-"):
                _, pid, _, size, _ = entry.name.split("-", 4)
                if pid_alive(int(pid)):
                    total += int(size)
                else:
                    Path(entry.path).unlink(missing_ok=True)
        self._write_usage(total)

    def reconcile(self) -> None:
        """Recount the ledger from disk. Run once per process start: a crash between a
        reservation and its fill would otherwise leak budget forever."""
        with self._lock(self.root / "state.lock"):
            self._recount()

    def usage_bytes(self) -> int:
        with self._lock(self.root / "state.lock"):
            return self._usage()

    def _usage(self) -> int:
        try:
            return int((self.root / "usage").read_bytes() or 0)
        except FileNotFoundError:
            return 0

    def _add_usage(self, delta: int) -> None:
        self._write_usage(max(0, self._usage() + delta))

    def _write_usage(self, value: int) -> None:
        # Overwritten in place at a fixed width: a full disk must not stop the bookkeeping
        # (a new file would need a new block), and the state lock is held.
        fd = os.open(self.root / "usage", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            os.pwrite(fd, b"%20d" % value, 0)
        finally:
            os.close(fd)

    # ---- paths and locks ----------------------------------------------------------------

    def _object(self, key: str) -> Path:
        return self.root / "objects" / key[:2] / key

    def _stripe(self, key: str) -> Path:
        return self.root / "locks" / key[:3]

    @contextmanager
    def _lock(self, path: Path) -> Iterator[None]:
        """An exclusive lock on `path` against other processes and this one's threads.

        flock locks belong to an open file description, so each call's own open() excludes
        other threads too. A fork while the lock is held (a DataLoader worker starting
        while a prefetch thread holds one) shares the description with the child, so the
        lock is dropped by an explicit unlock, never by close() alone: the child's copy of
        the descriptor would otherwise hold it for the child's lifetime.
        """
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)

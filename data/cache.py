"""A node-wide file cache on local disk, shared by every rank and worker process of a node.

Layout under `cache_dir`:

    objects/<k[:2]>/<k>   cached files: the payload, then a footer (magic, length, crc32)
    fills/                fills in progress: .tmp-<pid>-<thread>-<booked bytes>-<k>
    locks/<k[:3]>         fetch locks (4096 stripes), so one process fetches, others wait
    state.lock, usage     the byte ledger of objects/ and fills/, guarded by a file lock
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

A process start does not recount the cache (seconds at a million entries, and every rank of
a node starts at once): it only settles the fills of processes that died (a short listing of
fills/; a pid taken since by a later process counts as died). The ledger is recounted only when it cannot be trusted: a change to it is marked in
progress in the ledger itself until done, so a process killed in the middle of one leaves
the mark, and the next process to take the lock recounts, once for the node; so does the
first start after a reboot (the ledger names the boot that wrote it: page-cache writes may
have been lost) or in a cache without a ledger.
"""

from __future__ import annotations

import errno
import fcntl
import functools
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

from common.processes import pid_alive, started_at

log = logging.getLogger(__name__)

FOOTER = struct.Struct("<8sQI")  # magic, payload length, crc32 of the payload
MAGIC = b"GPCACHE1"
LOW_WATERMARK = 0.9  # eviction frees down to this fraction of the limit, to amortize scans
LRU_CLOCK_SECONDS = 60  # a hit refreshes a file's mtime when it is older than this
PID_CLOCK_SLACK = 2.0  # seconds: a process's start time is known to about a second
MAX_PID = 1 << 22  # Linux's highest pid_max
MAX_LEDGER_BYTES = 128  # the ledger is one fixed-width line of ~70 bytes
CLEAN, CHANGING = b"clean", b"dirty"  # the ledger's state: settled, or a change under way


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


@functools.lru_cache(maxsize=None)
def boot_id() -> Optional[bytes]:
    """This boot of the host (Linux), or None where the kernel does not say."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_bytes().strip() or None
    except OSError:
        return None


def _writer_alive(fill: Path, pid: int) -> bool:
    """Whether the process that writes `fill` lives: `pid` alive, and not a process that
    started after the fill was last written (the writer died and its pid was reused, which
    would keep its booking forever). False once the fill is gone."""
    if not pid_alive(pid):
        return False
    try:
        written = fill.lstat().st_mtime
    except FileNotFoundError:
        return False
    started = started_at(pid)
    return started is None or started <= written + PID_CLOCK_SLACK


def cache_key(url: str, size: int) -> str:
    # The size is part of the key, so a file replaced on the volume is not served stale.
    return hashlib.sha1(f"{url}\0{size}".encode()).hexdigest()


class NodeCache:
    """Safe to pickle into DataLoader workers: all shared state is on disk."""

    def __init__(self, root: Path, limit_bytes: int) -> None:
        self.root, self.limit_bytes = Path(root), int(limit_bytes)
        self._warned: Set[str] = set()
        for sub in ("objects", "fills", "locks"):
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
        with self._ledger():
            path.unlink(missing_ok=True)
            self._recount("a damaged file's booked size is unknown")
        return None

    # ---- writing and the byte budget ----------------------------------------------------

    def _store(self, path: Path, payload: bytes) -> None:
        size = len(payload) + FOOTER.size
        if size > self.limit_bytes:
            return  # larger than the whole budget: read through
        path.parent.mkdir(exist_ok=True)
        for _ in range(2):
            # The temporary name carries the booked size and the pid, so that a start can
            # give back a dead process's booking without recounting.
            tmp = self.root / "fills" / (f".tmp-{os.getpid()}-{threading.get_ident()}-"
                                         f"{size}-{path.name}")
            if not self._reserve(size, tmp, self._eviction_candidates(size)):
                return  # the budget is taken by other processes' fills in flight
            try:
                with open(tmp, "r+b") as f:
                    f.write(payload)
                    f.write(FOOTER.pack(MAGIC, len(payload), zlib.crc32(payload)))
                os.replace(tmp, path)
                return
            except FileNotFoundError:
                # Another process's start removed the fill, and its booking, as a dead
                # one's: a pid alive on another host or in another PID namespace (runs
                # sharing the directory) looks dead there. This read goes on uncached.
                return
            except OSError as err:
                with self._ledger():
                    tmp.unlink(missing_ok=True)
                    self._add_usage(-size)
                    if err.errno == errno.ENOSPC:
                        self._warn_once("cache disk at %s is full before data.cache_limit_gb "
                                        "is reached: evicting least-recently-used files; set "
                                        "data.cache_limit_gb below the disk's free space")
                        self._evict(max(4 * size, self._usage() // 10))
                if err.errno != errno.ENOSPC:
                    raise
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
        with self._ledger():
            if self._usage() + size > self.limit_bytes:
                need = self._usage() + size - int(self.limit_bytes * LOW_WATERMARK)
                self._evict(need, candidates)
            if self._usage() + size > self.limit_bytes:
                return False
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
        the ledger in one write (in a change to the ledger: a crash in between leaves it
        marked for a recount); the bytes freed."""
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
            try:
                st = entry.stat()
            except FileNotFoundError:
                continue
            yield st.st_mtime, st.st_size, Path(entry.path)

    def _fills(self) -> Iterator[Tuple[Path, int, int, str]]:
        """(path, pid, booked bytes, key) of every fill in progress, or left by a dead
        process."""
        for entry in os.scandir(self.root / "fills"):
            try:
                _, pid, _, size, key = entry.name.split("-", 4)
                pid_number = int(pid)
                ours = entry.is_file(follow_symlinks=False) and 0 < pid_number <= MAX_PID
            except (ValueError, OSError):
                continue
            if ours:  # else a directory, a link, or a pid no process can have: not a fill
                yield Path(entry.path), pid_number, int(size), key

    def _recount(self, why: str) -> int:
        """Set the ledger to the finished objects plus the live fills' bookings, and
        delete the fills whose process died (lock held); the objects counted.

        A fill is renamed into objects/ without the lock, so one may be seen in both
        listings: it counts once, unless its fill file still exists after the objects
        were listed (then both are on disk)."""
        live = {}
        for path, pid, size, key in self._fills():
            if _writer_alive(path, pid):
                live[key] = (path, size)
            else:
                path.unlink(missing_ok=True)
        total = objects = 0
        renamed = set()
        for _, size, path in self._scan():
            if path.name.startswith(".tmp-"):  # a fill of a version that kept them here
                path.unlink(missing_ok=True)
                continue
            total, objects = total + size, objects + 1
            if path.name in live:
                renamed.add(path.name)
        total += sum(size for key, (path, size) in live.items()
                     if key not in renamed or path.exists())
        self._write_usage(total, CLEAN)
        log.info("recounted the cache ledger at %s (%s): %d objects, %d bytes",
                 self.root, why, objects, total)
        return objects

    def _settle_dead_fills(self) -> int:
        """Give back the bookings of fills whose process died, and delete them (in a change
        to the ledger); the bytes given back."""
        freed = 0
        for path, pid, size, _ in self._fills():
            if not _writer_alive(path, pid):
                try:
                    path.unlink()
                except FileNotFoundError:
                    continue  # renamed meanwhile: a live fill after all, from another host
                freed += size
        if freed:
            self._add_usage(-freed)
        return freed

    def reconcile(self) -> int:
        """Run once per process start: give back what the fills of dead processes booked
        (a crash between a reservation and its rename would otherwise leak budget
        forever), after recounting the ledger if it cannot be trusted (see the module's
        docstring); the objects recounted, 0 when the ledger was trusted."""
        with self._ledger(at_start=True) as recounted:
            self._settle_dead_fills()
        return recounted

    def usage_bytes(self) -> int:
        with self._ledger(change=False):
            return self._usage()

    @contextmanager
    def _ledger(self, change: bool = True, at_start: bool = False) -> Iterator[int]:
        """The state lock, with a ledger that can be trusted: recounted first if a process
        died in the middle of a change (or, `at_start`, if another boot wrote it); yields
        the objects recounted, 0 if none. A `change` is marked in the ledger until it is
        done, so that if this process dies in it (or an error escapes it), the next one
        recounts."""
        with self._lock(self.root / "state.lock"):
            why = self._distrust(at_start)
            recounted = self._recount(why) if why else 0
            if change:
                self._write_usage(self._usage(), CHANGING)
            yield recounted
            if change:
                self._write_usage(self._usage(), CLEAN)

    def _distrust(self, at_start: bool) -> Optional[str]:
        """Why the ledger cannot be trusted (lock held), or None."""
        _, booted, state = self._record()
        if state == CHANGING:
            return "a process died changing it"
        if state != CLEAN:
            return "no ledger yet"
        if at_start and boot_id() is None:
            return "this host names no boot, so a reboot cannot be told from a restart"
        if at_start and booted != boot_id():
            return "written before this boot"
        return None

    def _record(self) -> Tuple[int, bytes, bytes]:
        """The ledger: (bytes booked, the boot that wrote it, its state); state b"" when
        there is none, or it is not one of ours."""
        try:
            with open(self.root / "usage", "rb") as f:
                fields = f.read(MAX_LEDGER_BYTES + 1).split()  # a huge file is not ours
        except FileNotFoundError:
            return 0, b"", b""
        if len(fields) != 3 or not fields[0].isdigit() or fields[2] not in (CLEAN, CHANGING):
            return 0, b"", b""
        return int(fields[0]), fields[1], fields[2]

    def _usage(self) -> int:
        return self._record()[0]

    def _add_usage(self, delta: int) -> None:
        self._write_usage(max(0, self._usage() + delta), CHANGING)

    def _write_usage(self, value: int, state: bytes) -> None:
        # Overwritten in place at a fixed width: a full disk must not stop the bookkeeping
        # (a new file would need a new block), and the state lock is held.
        record = b"%20d %-36s %s\n" % (value, boot_id() or b"-", state)
        fd = os.open(self.root / "usage", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            os.pwrite(fd, record, 0)
            if os.fstat(fd).st_size > len(record):  # a ledger of another layout
                os.ftruncate(fd, len(record))
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

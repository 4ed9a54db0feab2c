"""Where checkpoints live: a local or mounted path, or any fsspec URL (s3://, gs://, ...).

Local paths get the durability the commit protocol relies on: files are fsynced, small files
are written by temp + rename, and a rename is followed by an fsync of the parent directory.
An object store (any URL) has neither directories nor rename: `renames` is False there, and
the commit protocol writes in place, markers last (`checkpointing.commit`). Its listings are
never served from fsspec's cache, since other ranks and processes write there too.
"""

from __future__ import annotations

import errno
import os
import shutil
import uuid
from pathlib import Path
from typing import Any, BinaryIO, Callable, Dict, List, Mapping, Optional, Tuple, TypeVar

import fsspec
from fsspec.implementations.local import LocalFileSystem

from checkpointing.checksums import checksum_of
from common.redact import one_line, strip_credentials
from common.files import CHUNK, atomic_write, fsync_dir, open_regular
from common.retry import retry

# Network mounts report some conditions as errors that pass: rclone's write-back cache, for
# one, answers EIO for a file whose upload is still pending after its directory was renamed.
TRANSIENT_ERRNOS = {errno.EIO, errno.EAGAIN, errno.ESTALE, errno.ETIMEDOUT, errno.EBUSY}
READ_ATTEMPTS = 8
T = TypeVar("T")


def _retrying(read: Callable[[], T]) -> T:
    """Run a read, retrying transient errors with exponential backoff (~25 s in all)."""
    return retry(read, READ_ATTEMPTS, 0.2,
                 lambda err: isinstance(err, OSError) and err.errno in TRANSIENT_ERRNOS)


class StoreUnavailable(ValueError):
    """A URL whose protocol fsspec does not know, or whose package is not installed."""


class Store:
    def __init__(self, url: str, storage_options: Optional[Mapping[str, Any]] = None) -> None:
        """`storage_options`: fsspec's options for the URL's filesystem (an S3-compatible
        endpoint, credentials, ...), as `fsspec.open` takes them."""
        self.url = str(url)
        if strip_credentials(self.url) != self.url:  # every error and log line would show them
            raise StoreUnavailable(f"{strip_credentials(self.url)} holds credentials in its "
                                   f"URL: pass them in the storage's environment variables "
                                   f"(AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, ...) instead")
        self.storage_options = dict(storage_options or {})
        try:
            self.fs, self.root = fsspec.core.url_to_fs(self.url, **self.storage_options)
        except (ValueError, ImportError) as err:
            raise StoreUnavailable(f"cannot open {self.url}: {one_line(err, named=False)} (a "
                                   f"URL needs its fsspec package, e.g. s3fs for s3://)") \
                from None
        self.is_local = isinstance(self.fs, LocalFileSystem)
        if self.is_local:
            self.root = os.path.abspath(self.root)
        elif "//" in self.root.rstrip("/"):
            # A key's "//" is an empty name, not "/": SeaweedFS lists `b//run` as `b/run` but
            # reads only the literal key, so a save there waits for markers it never sees
            raise StoreUnavailable(f"{self.url} has an empty path segment ('//'): write it "
                                   f"with single slashes")
        # A directory renames in one step only on a file system; an object store "renames" a
        # prefix by copying and deleting each object, which can fail halfway
        self.renames = self.is_local

    def path(self, *parts: str) -> str:
        return "/".join([self.root.rstrip("/"), *parts])

    def url_of(self, *parts: str) -> str:
        """`path(...)` with its protocol, for readers that open it themselves."""
        path = self.path(*parts)
        return path if self.is_local else self.fs.unstrip_protocol(path)

    def makedirs(self, path: str) -> None:
        """A directory on a file system; nothing on an object store, whose prefixes need none
        (and where s3fs would create a missing bucket, typo or not)."""
        if self.is_local:
            self.fs.makedirs(path, exist_ok=True)

    def listdir(self, path: str | None = None) -> List[str]:
        """Entry names (not paths) under `path` (default: the root); [] when it is missing."""
        path = path or self.root
        self.fs.invalidate_cache(path)
        try:
            return sorted(os.path.basename(p.rstrip("/")) for p in self.fs.ls(path, detail=False))
        except FileNotFoundError:
            return []

    def entries(self, path: str | None = None) -> Dict[str, Tuple[bool, int]]:
        """{name: (a regular file?, size)} of the entries under `path` (default: the root),
        from one listing: an object store's gives the sizes, so a checkpoint of 4,096 ranks
        is checked without a request per file (locally, one lstat each). {} when missing."""
        path = path or self.root
        try:
            if self.is_local:
                with os.scandir(path) as listing:
                    return {e.name: (e.is_file(follow_symlinks=False),
                                     e.stat(follow_symlinks=False).st_size) for e in listing}
            self.fs.invalidate_cache(path)  # other processes' markers land meanwhile
            listing = _retrying(lambda: self.fs.ls(path, detail=True))
        except FileNotFoundError:
            return {}
        return {os.path.basename(i["name"].rstrip("/")): (i.get("type") == "file",
                                                          int(i.get("size") or 0))
                for i in listing}

    def exists(self, path: str) -> bool:
        self.fs.invalidate_cache(path)
        return self.fs.exists(path)

    def size(self, path: str) -> int:
        return int(_retrying(lambda: self.fs.size(path)))

    def checksum(self, path: str, algorithm: str) -> str:
        """The hex digest of the file at `path` (an algorithm of `checkpointing.checksums`)."""
        def read() -> str:
            with self.open_file(path) as f:
                return checksum_of(f, algorithm)

        return _retrying(read)

    def open_file(self, path: str) -> BinaryIO:
        """`path` opened to read; locally a regular file only, not through a link (OSError
        else). A listing checked it, but another rank reads it later: a FIFO put there
        meanwhile would block its open, a link to /dev/zero its read, for good."""
        if not self.is_local:
            return self.fs.open(path, "rb")
        return os.fdopen(open_regular(path, os.O_RDONLY | os.O_NOFOLLOW), "rb")

    def read_bytes(self, path: str) -> bytes:
        return _retrying(lambda: self.fs.cat_file(path))

    def write_bytes(self, path: str, data: bytes) -> None:
        """Whole or not at all: a reader never sees half of it."""
        if not self.is_local:
            self.fs.pipe_file(path, data)  # object stores commit a PUT atomically
            return
        atomic_write(path, data)

    def check_writable(self) -> None:
        """Create the root if missing, then write, fsync and remove a probe file in it, as a
        checkpoint would; raises OSError when that fails."""
        self.makedirs(self.root)
        probe = self.path(f".write-probe-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        self.write_bytes(probe, b"probe")
        self.remove(probe)

    def put(self, local_file: Path, path: str) -> None:
        """Copy a local file in (the upload from the staging tier)."""
        if not self.is_local:
            self.fs.put_file(str(local_file), path)
            return
        with open(local_file, "rb") as src, open(path, "wb") as dst:
            shutil.copyfileobj(src, dst, CHUNK)
            dst.flush()
            os.fsync(dst.fileno())

    def rename(self, src: str, dst: str) -> None:
        """Atomic, so only where `renames`: the commit protocol never asks an object store."""
        assert self.renames, f"{self.url} cannot rename a directory"
        os.rename(src, dst)
        fsync_dir(os.path.dirname(dst))

    def remove(self, path: str) -> None:
        try:
            self.fs.rm(path, recursive=True)
        except FileNotFoundError:
            pass
        if not self.is_local:
            # The prefix's folder marker, the key `path/`: what consoles create as a folder,
            # and what stores with folders (SeaweedFS) keep listing once they are empty
            try:
                self.fs.rm_file(path.rstrip("/") + "/")
            except FileNotFoundError:
                pass

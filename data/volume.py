"""One view of where the JPEGs live: a mounted path or any fsspec URL.

`/Volumes/cat/db/imagenet`, an NFS or FUSE mount, `s3://bucket/imagenet`, `gs://...`,
`http://host/imagenet/`: all go through fsspec, so the rest of the pipeline sees one
`read(relative_path) -> bytes`. Network reads fail now and then; a transient error is retried
with exponential backoff and, when the retries run out, ends the run with one clear line.
A *permanent* per-file error (the file is gone, or not readable) is not retried: it is a bad
file, and the dataset decides whether to skip it or fail (`data.on_bad_file`).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Tuple, TypeVar

import fsspec

import data.slowfs  # noqa: F401  registers slow:// (a simulated remote volume)
from data.errors import DatasetError

T = TypeVar("T")

# Errors that say "this file cannot be read as asked", which no retry can change.
PERMANENT_ERRORS = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)


def _transient_errors() -> Tuple[type, ...]:
    errors: List[type] = [OSError, TimeoutError, ConnectionError]
    try:  # fsspec's HTTP filesystem raises aiohttp's own errors (e.g. on a 503)
        import aiohttp
        errors.append(aiohttp.ClientError)
    except ImportError:
        pass
    return tuple(errors)


TRANSIENT_ERRORS = _transient_errors()


class MissingPathError(DatasetError):
    """A directory the dataset needs is not there."""


class BadFileError(Exception):
    """A file that can never be read as a training sample; retrying will not help."""


@dataclass
class Volume:
    """A dataset root (mounted path or fsspec URL); safe to pickle into DataLoader workers."""

    url: str
    retries: int = 5
    backoff_seconds: float = 0.1
    _root: str = field(default="", init=False, repr=False, compare=False)
    _fs: Any = field(default=None, init=False, repr=False, compare=False)
    _pid: int = field(default=-1, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._root = fsspec.core.url_to_fs(self.url)[1].rstrip("/")

    @property
    def fs(self) -> Any:
        """This process's filesystem. Forked DataLoader workers must not share the parent's:
        an async one (HTTP, S3) holds an event loop and sessions that belong to it."""
        if self._pid != os.getpid():
            self._fs = fsspec.core.url_to_fs(self.url, skip_instance_cache=True)[0]
            self._pid = os.getpid()
        return self._fs

    def __getstate__(self) -> Dict[str, Any]:
        return {"url": self.url, "retries": self.retries, "backoff_seconds": self.backoff_seconds}

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._fs, self._pid = None, -1
        self.__post_init__()

    def path(self, relative: str) -> str:
        return f"{self._root}/{relative}" if relative else self._root

    def with_retries(self, what: str, action: Callable[[], T]) -> T:
        """`action()`, retried with backoff on transient errors; permanent ones propagate."""
        for attempt in range(self.retries + 1):
            try:
                return action()
            except PERMANENT_ERRORS:
                raise
            except TRANSIENT_ERRORS as err:
                if attempt == self.retries:
                    raise DatasetError(
                        f"{what} failed {self.retries + 1} times (last error: "
                        f"{type(err).__name__}: {err}): check that data.root {self.url} is "
                        f"reachable, or raise data.read_retries") from err
                time.sleep(self.backoff_seconds * 2 ** attempt)
        raise AssertionError("unreachable")

    def read(self, relative: str) -> bytes:
        """The bytes of one file; BadFileError when it is gone or unreadable."""
        path = self.path(relative)
        try:
            return self.with_retries(f"reading {path}", lambda: self.fs.cat_file(path))
        except PERMANENT_ERRORS as err:
            raise BadFileError(f"cannot read {path}: {type(err).__name__}: {err}") from err

    def list_dir(self, relative: str) -> List[Dict[str, Any]]:
        """Entries of a directory as `{"name": basename, "type", "size"}`, sorted by name."""
        path = self.path(relative)
        try:
            entries = self.with_retries(f"listing {path}",
                                        lambda: self.fs.ls(path, detail=True))
        except FileNotFoundError:
            raise MissingPathError(f"{path} does not exist: set data.root to a folder holding "
                               f"train/<class>/*.jpg and val/<class>/*.jpg") from None
        except PERMANENT_ERRORS as err:
            raise DatasetError(f"cannot list {path} ({type(err).__name__}): fix its "
                               f"permissions or point data.root elsewhere") from None
        out = []
        for entry in entries:
            if entry["name"].rstrip("/") == path.rstrip("/"):  # some stores list the dir itself
                continue
            name = entry["name"].rstrip("/").rsplit("/", 1)[-1]
            out.append({"name": name, "type": entry["type"], "size": entry.get("size")})
        return sorted(out, key=lambda e: e["name"])

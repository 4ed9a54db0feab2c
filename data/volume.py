"""One view of where the JPEGs live: a mounted path or any fsspec URL.

`/Volumes/cat/db/imagenet`, an NFS or FUSE mount, `s3://bucket/imagenet`, `gs://...`,
`http://host/imagenet/`: all go through fsspec, so the rest of the pipeline sees one
`read(relative_path) -> bytes`. Network reads fail now and then; a transient error is retried
with exponential backoff and, when the retries run out, ends the run with one clear line.
A *permanent* per-file error (the file is gone, or not readable) is not retried: it is a bad
file, and the dataset decides whether to skip it or fail (`data.on_bad_file`).
"""

from __future__ import annotations

import errno
import os
import stat
import urllib.parse
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable, Dict, List, Tuple, TypeVar

import fsspec
from fsspec.implementations.local import LocalFileSystem

from common.retry import retry
import data.slowfs  # noqa: F401  registers slow:// (a simulated remote volume)
from data.errors import DatasetError
from common.redact import one_line, strip_credentials

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


def _is_transient(err: Exception) -> bool:
    return isinstance(err, TRANSIENT_ERRORS) and not isinstance(err, PERMANENT_ERRORS)


def fsspec_target(url: str) -> Tuple[str, Dict[str, Any]]:
    """(URL, fsspec options) for opening `url`, with an http(s) URL's user info moved into
    basic auth: fsspec's HTTP filesystem keeps the whole URL as the path, and paths end up in
    log lines, the stored index and cache keys. (Other filesystems take it out themselves.)"""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme.lower() not in ("http", "https") or "@" not in parts.netloc:
        return url, {}
    import aiohttp  # fsspec's HTTP filesystem needs it anyway

    auth = aiohttp.BasicAuth(urllib.parse.unquote(parts.username or ""),
                             urllib.parse.unquote(parts.password or ""))
    bare = urllib.parse.urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))
    return bare, {"client_kwargs": {"auth": auth}}


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
    # fsspec's options for the URL's filesystem (an S3-compatible endpoint, credentials, ...)
    storage_options: Dict[str, Any] = field(default_factory=dict, repr=False)
    _root: str = field(default="", init=False, repr=False, compare=False)
    _fs: Any = field(default=None, init=False, repr=False, compare=False)
    _pid: int = field(default=-1, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        try:
            url, options = self._target()
            self._root = fsspec.core.url_to_fs(url, **options)[1].rstrip("/")
        except (ValueError, ImportError) as err:  # unknown protocol, or its package missing
            raise DatasetError(
                f"cannot open data.root={strip_credentials(self.url)}: "
                f"{one_line(err, named=False)} (a URL needs its fsspec "
                f"package, e.g. s3fs for s3://)") from None

    def _target(self) -> Tuple[str, Dict[str, Any]]:
        url, options = fsspec_target(self.url)
        return url, {**options, **self.storage_options}

    @property
    def fs(self) -> Any:
        """This process's filesystem. Forked DataLoader workers must not share the parent's:
        an async one (HTTP, S3) holds an event loop and sessions that belong to it."""
        if self._pid != os.getpid():
            url, options = self._target()
            self._fs = fsspec.core.url_to_fs(url, skip_instance_cache=True, **options)[0]
            self._pid = os.getpid()
        return self._fs

    def __getstate__(self) -> Dict[str, Any]:
        return {"url": self.url, "retries": self.retries, "backoff_seconds": self.backoff_seconds,
                "storage_options": self.storage_options}

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._fs, self._pid = None, -1
        self.__post_init__()

    def path(self, relative: str) -> str:
        return f"{self._root}/{relative}" if relative else self._root

    def url_of(self, relative: str) -> str:
        """`path(relative)` with its protocol: what names a file in the node cache and a
        split in the stored indexes, so one path in two stores (`s3://b/x`, `gs://b/x`)
        never shares an entry in a cache that every run of a node shares. A local path
        stays a plain path."""
        path = self.path(relative)
        if isinstance(self.fs, LocalFileSystem) and self.fs.protocol == ("file", "local"):
            return path
        return self.fs.unstrip_protocol(path)

    def with_retries(self, what: str, action: Callable[[], T]) -> T:
        """`action()`, retried with backoff on transient errors; permanent ones propagate."""
        try:
            return retry(action, self.retries + 1, self.backoff_seconds, _is_transient)
        except PERMANENT_ERRORS:
            raise
        except TRANSIENT_ERRORS as err:
            raise DatasetError(
                f"{what} failed {self.retries + 1} times (last error: "
                f"{type(err).__name__}: {err}): check that data.root "
                f"{strip_credentials(self.url)} is reachable, or raise "
                f"data.read_retries") from err

    def read(self, relative: str) -> bytes:
        """The bytes of one file; BadFileError when it is gone or unreadable."""
        path = self.path(relative)
        try:
            return self.with_retries(f"reading {path}", lambda: self.fs.cat_file(path))
        except PERMANENT_ERRORS as err:
            raise BadFileError(f"cannot read {path}: {type(err).__name__}: {err}") from err

    def list_dir(self, relative: str) -> List[Dict[str, Any]]:
        """Entries of a directory as `{"name": basename, "type", "size"}`, sorted by name;
        type is "directory", "file", "other", or "broken" (a symlink that leads nowhere)."""
        path = self.path(relative)
        # fsspec's local listing types a symlink "other", whatever it points to, and a mounted
        # volume is a local path too: links are followed here instead, as ImageFolder does.
        if isinstance(self.fs, LocalFileSystem):
            listing = partial(_scandir_following_links, path)
        else:
            listing = partial(self.fs.ls, path, detail=True)
        try:
            entries = self.with_retries(f"listing {path}", listing)
        except (FileNotFoundError, NotADirectoryError):
            raise MissingPathError(f"{path} does not exist or is not a directory: set data.root "
                                   f"to a folder holding train/<class>/*.jpg and "
                                   f"val/<class>/*.jpg") from None
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


# A symlink whose target is missing, unreachable or a loop: that link is broken for good.
_BROKEN_LINK_ERRNOS = frozenset([errno.ENOENT, errno.ENOTDIR, errno.EACCES, errno.EPERM,
                                 errno.ELOOP])


def _scandir_following_links(path: str) -> List[Dict[str, Any]]:
    """A local directory's entries as fsspec's `ls(detail=True)` gives them, but with each
    symlink typed by its target; a link that leads nowhere (dangling, a loop, no permission)
    has type "broken". Nothing is descended into, so a link loop costs one failed stat."""
    out = []
    with os.scandir(path) as entries:
        for entry in entries:
            try:
                st = entry.stat(follow_symlinks=True)
            except OSError as err:
                if err.errno not in _BROKEN_LINK_ERRNOS:
                    raise  # e.g. EIO on a network mount: the whole listing is retried
                out.append({"name": f"{path}/{entry.name}", "type": "broken", "size": None})
                continue
            kind = ("directory" if stat.S_ISDIR(st.st_mode)
                    else "file" if stat.S_ISREG(st.st_mode) else "other")
            out.append({"name": f"{path}/{entry.name}", "type": kind, "size": st.st_size})
    return out

"""Writing a file whole or not at all, durably, and appending to one safely.

One durability rule for every file the trainer replaces: the new content goes to a temp
file in the same directory (so the rename cannot cross filesystems), which is fsynced, then
renamed over the target, and then the directory is fsynced so the rename itself survives a
power loss. A reader sees the old content or the new, never half of it.
"""

from __future__ import annotations

import errno
import os
import stat
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO, Iterator, Union

CHUNK = 4 << 20
PathLike = Union[str, "os.PathLike[str]"]


def fsync_dir(path: PathLike) -> None:
    """Make a rename or creation in directory `path` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        _fsync_dir_fd(fd)
    finally:
        os.close(fd)


def _fsync_dir_fd(fd: int) -> None:
    try:
        os.fsync(fd)
    except OSError:  # some FUSE mounts do not implement fsync on directories
        pass


@contextmanager
def atomic_file(path: PathLike) -> Iterator[BinaryIO]:
    """A binary file to write `path`'s new content to. When the block ends normally, the
    content replaces `path` (see the module docstring); when it raises, `path` is untouched
    and the temp file is removed, so e.g. a full disk leaves nothing taking room."""
    path = Path(path)
    # pid and thread: two writers of one path never share a temp file
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{threading.get_ident()}")
    try:
        with open(tmp, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        # Opened before the rename: once the file is visible another process may rename
        # its directory (rank 0 commits a checkpoint as soon as every marker is in), and a
        # descriptor still reaches the directory where its old path no longer does.
        parent = os.open(path.parent, os.O_RDONLY)
        try:
            os.replace(tmp, path)
            _fsync_dir_fd(parent)
        finally:
            os.close(parent)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def atomic_write(path: PathLike, data: bytes) -> None:
    """Replace `path`'s content with `data`, whole or not at all (`atomic_file`)."""
    with atomic_file(path) as f:
        f.write(data)


def ends_torn(path: PathLike) -> bool:
    """Whether the non-empty file `path` ends inside a line (an append cut short, e.g. by a
    full disk): the next appended line must then start with a newline of its own."""
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        if f.tell() == 0:
            return False
        f.seek(-1, os.SEEK_END)
        return f.read(1) != b"\n"


def open_regular(path: PathLike, flags: int, stream: bool = False) -> int:
    """A descriptor on `path`, which must be a regular file (or a link to one), or with
    `stream` a FIFO a writer feeds (its open waits for one): an appender's open on a FIFO
    would wait for a reader for good, a device such as /dev/zero would never end."""
    fd = os.open(path, flags if stream else flags | os.O_NONBLOCK, 0o644)
    try:
        mode = os.fstat(fd).st_mode
        if not (stat.S_ISREG(mode) or stream and stat.S_ISFIFO(mode)):
            raise OSError(errno.EINVAL, "not a regular file", str(path))
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd

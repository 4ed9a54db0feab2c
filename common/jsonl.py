"""The append-only JSON-lines file that several processes write at once: the audit ledger,
the event timeline, a sweep's record of its jobs.

Writing: each line is one `os.write` on an `O_APPEND` descriptor, so lines of concurrent
writers never interleave; when the file ended inside a line (an append cut short by a full
disk or a kill), a writer's first line begins with a newline, so it starts a line of its
own (racing writers may leave a blank line or two; readers skip them).

Reading: the file is hostile input (a torn last line, garbage, a line of gigabytes, JSON
nested past the parser's stack). `lines` never holds more than `max_bytes` of one line;
`records` yields the well-formed JSON objects, one at a time.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, Mapping, Optional, Tuple, Union

from common.files import ends_torn, open_regular

MAX_LINE_BYTES = 1 << 16  # a line longer than this is garbage, skipped unread

PathLike = Union[str, Path]


class Appender:
    """This process's appender to a JSON-lines file; `append` raises OSError when the line
    did not go in whole (a full disk)."""

    def __init__(self, path: PathLike) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd: Optional[int] = open_regular(self.path,
                                               os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        try:
            self._first = b"\n" if ends_torn(self.path) else b""
        except BaseException:
            self.close()
            raise

    def append(self, record: Mapping[str, Any]) -> None:
        """`record` as one line, in a single append."""
        if self._fd is None:
            raise OSError(f"{self.path} is closed")
        data = self._first + (json.dumps(record, separators=(",", ":")) + "\n").encode()
        written = os.write(self._fd, data)
        if written != len(data):  # a regular file takes an append whole, or it is full
            raise OSError(f"short write to {self.path} ({written} of {len(data)} bytes)")
        self._first = b""

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> "Appender":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def append_line(path: PathLike, record: Mapping[str, Any]) -> None:
    """One line appended to `path` by a process that writes only that one."""
    with Appender(path) as appender:
        appender.append(record)


def lines(path: PathLike, max_bytes: int = MAX_LINE_BYTES) -> Iterator[Tuple[bytes, bool]]:
    """(line, whole) for each line of `path`, never holding more than `max_bytes` of one: a
    longer line is given as (b"", False), the last line when it has no newline (torn, or
    whole but for its newline) as (its bytes, False)."""
    with os.fdopen(open_regular(path, os.O_RDONLY, stream=True), "rb") as f:
        while True:
            line = f.readline(max_bytes + 1)
            if not line:
                return
            if line.endswith(b"\n"):
                yield line, True
                continue
            if len(line) <= max_bytes:  # the file ends here
                yield line, False
                return
            while line and not line.endswith(b"\n"):  # too long: skip to its end
                line = f.readline(max_bytes + 1)
            yield b"", False


def records(path: PathLike, max_bytes: int = MAX_LINE_BYTES,
            parse_int: Optional[Callable[[str], Any]] = None) -> Iterator[Dict[str, Any]]:
    """The JSON objects of `path`'s lines, in file order, one at a time; a torn, long, blank
    or foreign line is skipped (a last line that parses lacks only its newline). `parse_int` as `json.loads` takes it (float: a huge
    integer parses as inf, for the caller's range check, not as 5,000 digits)."""
    for line, _ in lines(path, max_bytes):
        if not line.strip():
            continue
        try:
            record = json.loads(line, parse_int=parse_int)
        except (ValueError, RecursionError):
            continue
        if isinstance(record, dict):
            yield record

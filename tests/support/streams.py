"""Is a reader streaming? Feed it through a FIFO whose writer holds back the rest of the
file until the reader has handed back its first record: a reader that takes the whole file
first only gets its first record after the rest was written."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Callable, Iterable, List, Sequence, Tuple, TypeVar

T = TypeVar("T")


def read_through_fifo(path: Path, lines: Sequence[str], reader: Callable[[Path], Iterable[T]]
                      ) -> Tuple[List[T], bool]:
    """(all the records `reader(path)` yields for `lines` written to a FIFO at `path`,
    whether the first came before the second line was written)."""
    os.mkfifo(path)
    first_read, rest_written = threading.Event(), threading.Event()

    def write() -> None:
        with open(path, "w") as f:
            f.write(lines[0] + "\n")
            f.flush()
            first_read.wait(timeout=20)
            rest_written.set()
            f.writelines(line + "\n" for line in lines[1:])

    writer = threading.Thread(target=write)
    writer.start()
    records: List[T] = []
    streamed = False
    try:
        read = iter(reader(path))
        records.append(next(read))
        streamed = not rest_written.is_set()
        first_read.set()
        records += list(read)
    finally:
        first_read.set()
        writer.join()
    return records, streamed

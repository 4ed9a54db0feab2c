"""DCP's file writer, checksumming every file as it writes it.

The checksums (`checkpointing.checksums.WRITE_ALGORITHM`) are taken from the bytes on their
way to the file, so the commit never reads the files back. The writer may run in DCP's
checkpoint process (`checkpoint.async_mode=process`), which shares no memory with the
trainer: it leaves its records in a small sidecar file that the rank's commit reads (and
removes) before writing its marker.
"""

from __future__ import annotations

import json
import logging
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO, Dict, Generator, Tuple

import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem

from checkpointing.checksums import WRITE_ALGORITHM, hasher

Records = Dict[str, Tuple[int, str]]  # file name -> (size, hex checksum)


class _HashingStream:
    """A binary file opened for writing that hashes and counts what passes through it."""

    def __init__(self, raw: BinaryIO) -> None:
        self.raw = raw
        self.digest = hasher(WRITE_ALGORITHM)
        self.size = 0

    def write(self, data: Any) -> int:
        view = memoryview(data)  # torch.save hands over views of tensor storage: no copy
        written = self.raw.write(view)
        self.digest.update(view)
        self.size += view.nbytes
        return written

    def tell(self) -> int:
        return self.raw.tell()

    def flush(self) -> None:
        self.raw.flush()

    def fileno(self) -> int:
        return self.raw.fileno()

    def close(self) -> None:
        self.raw.close()


class ChecksummingFileSystem(FileSystem):
    """DCP's local file system, recording the size and checksum of each file it writes,
    by name (the files of a save share one directory). A record follows its file through
    `rename`: DCP writes `.metadata` under a temporary name."""

    def __init__(self) -> None:
        super().__init__()
        self.records: Records = {}

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str
                      ) -> Generator[Any, None, None]:
        with super().create_stream(path, mode) as raw:
            if mode != "wb":
                yield raw
                return
            stream = _HashingStream(raw)
            yield stream
        self.records[Path(path).name] = (stream.size, stream.digest.hexdigest())

    def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
        super().rename(path, new_path)
        record = self.records.pop(Path(path).name, None)
        if record is not None:
            self.records[Path(new_path).name] = record


def _sidecar(directory: str | os.PathLike, rank: int) -> Path:
    return Path(directory, f".checksums_rank_{rank}.json")


def take_records(directory: str | os.PathLike, rank: int) -> Records:
    """What rank `rank`'s writer recorded in `directory` for its files; removes the record."""
    path = _sidecar(directory, rank)
    records = json.loads(path.read_text())
    path.unlink()
    return {name: (int(size), str(checksum)) for name, (size, checksum) in records.items()}


def _not_a_failed_save(record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith("Checkpoint save failed")


class Writer(FileSystemWriter):
    """DCP's file writer with checksums. With `async_mode=process` it runs in DCP's
    background process, which logs a failed save with every rank's traceback before handing
    the error back; the trainer reports it in one line, so that process drops its own
    record."""

    def __init__(self, path: str | os.PathLike, rank: int) -> None:
        super().__init__(path, sync_files=True)
        self.fs = ChecksummingFileSystem()
        self.sidecar = _sidecar(path, rank)

    def write_data(self, *args: Any, **kwargs: Any) -> Any:
        root = logging.getLogger()
        if _not_a_failed_save not in root.filters:
            root.addFilter(_not_a_failed_save)
        # torch.save's zip records each carry a CRC32 that costs more CPU than the write;
        # the whole-file checksum already covers those bytes. The option is process-wide:
        # a torch.save in another thread meanwhile (none in the trainer: model_final.pt is
        # written after the last save) would skip its CRCs too, which torch.load accepts.
        crc32 = torch.serialization.get_crc32_options()
        torch.serialization.set_crc32_options(False)
        try:
            result = super().write_data(*args, **kwargs)
        finally:
            torch.serialization.set_crc32_options(crc32)
        self._leave_records()
        return result

    def finish(self, *args: Any, **kwargs: Any) -> None:
        super().finish(*args, **kwargs)  # the coordinator (rank 0) writes .metadata
        self._leave_records()

    def _leave_records(self) -> None:
        # No fsync: the commit reads the sidecar on this node, and a crash before that
        # leaves a partial directory, which is never loaded.
        self.sidecar.write_text(json.dumps(self.fs.records))

"""DCP's file writer: one file per rank, in DCP's standard format, checksummed as written.

Each rank's items go into one file, `__<rank>_0.distcp`, as DCP's own `FileSystemWriter`
lays them out: a tensor is a `torch.save` archive of that tensor alone, a non-tensor item
the bytes DCP's planner serialized, and `.metadata` records where each one is (file,
offset, length). So stock `torch.distributed.checkpoint.load` and
`torch.distributed.checkpoint.format_utils.dcp_to_torch_save` read a checkpoint with no
module of this project imported. Each tensor is saved as a plain contiguous tensor that is
all of its storage, so its archive holds exactly its bytes in C order, which
`checkpointing.safe_load` reads straight into the live tensor; the archive is written byte
for byte as `torch.save` writes it, from a frame made once per dtype and shape
(`checkpointing.archive`), the bytes going from the staged tensor to the file.

`checkpoint.format=raw` (off by default) stores each tensor as its bare bytes instead, with
the descriptor `RAW` in `.metadata`: less CPU per save, but only this project's reader reads
it (DCP's stock reader refuses such an entry, "Unknown extension", rather than misreading
it; `python -m checkpointing.export` turns one into a plain `torch.save` file). Checkpoints
of either format, and of DCP's own writer, load.

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
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO, Dict, Generator, List, Optional, Tuple

import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX, FileSystem, _StorageInfo
from torch.distributed.checkpoint.planner import (SavePlan, SavePlanner, WriteItem,
                                                  WriteItemType)
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from checkpointing.archive import no_crc32, tensor_archive
from checkpointing.checksums import WRITE_ALGORITHM, hasher
from common.processes import leave_the_process_group_once

# The transform descriptor of a tensor stored as its raw bytes (C order, in this machine's
# byte order, which the name records), its dtype and shape being those `.metadata` gives
# its chunk. A machine of the other byte order finds no reader for it and refuses it.
RAW = f"raw_tensor_{sys.byteorder}_endian"

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


def _write_item(stream: Any, name: str, item: WriteItem, data: Any, raw: bool) -> WriteResult:
    offset = stream.tell()
    descriptors: Optional[Tuple[str, ...]] = None
    if item.type == WriteItemType.BYTE_IO:
        stream.write(data.getbuffer())
    elif data.layout != torch.strided or data.is_quantized:
        # No raw bytes to speak of, or bytes that mean nothing without their quantizer's
        # scale and zero point: `torch.save` keeps what they need.
        torch.save(data.detach().to("cpu"), stream)
    else:
        tensor = _standalone(data)
        frame = (b"", b"") if raw else tensor_archive(tensor.dtype, tuple(tensor.shape))
        if frame is None:  # a dtype only torch.save itself knows how to store
            torch.save(tensor, stream)
        else:
            # The bytes alone (raw), or framed as torch.save frames them: no pickling, and
            # three writes instead of torch's dozens of small ones
            head, tail = frame
            stream.write(head)
            stream.write(memoryview(tensor.reshape(-1).view(torch.uint8).numpy()))
            stream.write(tail)
            descriptors = (RAW,) if raw else None
    length = stream.tell() - offset
    return WriteResult(index=item.index, size_in_bytes=length,
                       storage_data=_StorageInfo(name, offset, length, descriptors))


def _standalone(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor`'s values as a plain contiguous CPU tensor that is all of its storage:
    `torch.save` writes a view's whole storage, and a reader that takes the stored bytes
    as the tensor's (`checkpointing.safe_load`) needs exactly them, in C order."""
    # On CUDA a synchronous save hands over device tensors; staged ones are on the CPU.
    # A conjugate or negative view holds its values unconjugated, un-negated: resolved.
    out = tensor.detach().to("cpu").resolve_conj().resolve_neg().contiguous()
    if out.storage_offset() or out.untyped_storage().nbytes() != out.numel() * out.itemsize:
        out = out.clone()
    return out


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
    record, and leaves the trainer's process group (common.processes)."""

    def __init__(self, path: str | os.PathLike, rank: int, raw: bool = False) -> None:
        super().__init__(path, sync_files=True)
        self.fs = ChecksummingFileSystem()
        self.raw = raw  # checkpoint.format=raw: tensors as bare bytes, only our reader's
        self.sidecar = _sidecar(path, rank)
        self.made_in = os.getpid()

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[List[WriteResult]]:
        """This rank's items into one file, `__<rank>_0.distcp`, fsynced."""
        root = logging.getLogger()
        if _not_a_failed_save not in root.filters:
            root.addFilter(_not_a_failed_save)
        if os.getpid() != self.made_in:  # in DCP's checkpoint process
            leave_the_process_group_once()
        name = f"{plan.storage_data.prefix}0{DEFAULT_SUFFIX}"
        # The archives' CRC32s off (checkpointing.archive): the file's checksum covers them
        with no_crc32(), self.fs.create_stream(self.fs.concat_path(self.path, name),
                                               "wb") as stream:
            results = [_write_item(stream, name, item, planner.resolve_data(item), self.raw)
                       for item in plan.items]
            stream.flush()
            os.fsync(stream.fileno())
        self._leave_records()
        done: Future[List[WriteResult]] = Future()
        done.set_result(results)
        return done

    def finish(self, *args: Any, **kwargs: Any) -> None:
        super().finish(*args, **kwargs)  # the coordinator (rank 0) writes .metadata
        self._leave_records()

    def _leave_records(self) -> None:
        # No fsync: the commit reads the sidecar on this node, and a crash before that
        # leaves a partial directory, which is never loaded.
        self.sidecar.write_text(json.dumps(self.fs.records))

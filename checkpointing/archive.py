"""The `torch.save` archive of one plain tensor, without `torch.save` on every save.

DCP's standard format stores each tensor as `torch.save(tensor)`: a zip archive of the
pickle (`data.pkl`), a few small records (format version, storage alignment, byte order),
the tensor's bytes (`data/0`), the archive version, the serialization id and the zip
directory. For a contiguous tensor that is all of its storage, everything but the bytes
depends only on its dtype and shape (the CRC32s being off, see `no_crc32`), so
`tensor_archive` has torch write that frame once, with `torch.serialization.skip_data`
(the tensor allocated, never touched), and caches it; the writer then writes the frame's
head, the tensor's bytes straight from the tensor, and its tail. The result is byte for
byte what `torch.save` writes (tests/test_checkpoint.py compares them), zip64 records
included for a tensor of 4 GB or more: torch wrote them.
"""

from __future__ import annotations

import functools
import io
import os
from contextlib import contextmanager
from typing import Any, Generator, List, Optional, Tuple

import torch


@contextmanager
def no_crc32() -> Generator[None, None, None]:
    """torch.save without the CRC32 of each zip record (it costs more CPU than the write;
    checkpoint files carry their own checksum, and torch.load does not check CRCs). The
    option is process-wide: a torch.save in another thread meanwhile skips its CRCs too,
    which torch.load accepts (the trainer writes model_final.pt after its last save)."""
    crc32 = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)
    try:
        yield
    finally:
        torch.serialization.set_crc32_options(crc32)


class _Frame:
    """A sink for a `skip_data` torch.save: keeps what it writes, split where it skips
    (a storage's bytes, which torch passes over with a relative seek)."""

    def __init__(self) -> None:
        self.parts: List[bytearray] = [bytearray()]

    def write(self, data: Any) -> int:
        view = memoryview(data)
        self.parts[-1] += view
        return view.nbytes

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        if whence != os.SEEK_CUR:
            raise io.UnsupportedOperation("torch.save skips data with relative seeks only")
        self.parts.append(bytearray())
        return 0

    def flush(self) -> None:
        pass


@functools.lru_cache(maxsize=4096)
def tensor_archive(dtype: torch.dtype, shape: Tuple[int, ...]
                   ) -> Optional[Tuple[bytes, bytes]]:
    """(head, tail): what `torch.save` (CRC32s off) writes before and after the bytes of a
    contiguous `dtype` tensor of `shape` that is all of its storage, for a writer that puts
    the tensor's bytes between them; None for a dtype no plain tensor has (quantized,
    bit-packed). The frame of an empty tensor is all head."""
    frame = _Frame()
    try:
        with no_crc32(), torch.serialization.skip_data():
            torch.save(torch.empty(shape, dtype=dtype), frame)
    except (RuntimeError, TypeError):
        return None
    if len(frame.parts) == 1:  # no bytes to skip: torch writes nothing for an empty storage
        return bytes(frame.parts[0]), b""
    head, tail = frame.parts
    return bytes(head), bytes(tail)

"""Loading a checkpoint never runs code from it.

DCP reads `.metadata` with a plain `pickle.load` and every non-tensor item with
`torch.load(weights_only=False)`: a planted file in a checkpoint directory would execute on
resume. Here `.metadata` goes through an unpickler that admits only DCP's own metadata types,
and non-tensor items through `torch.load(weights_only=True)` (plain data only: numbers,
strings, lists, dicts, tuples, tensors). Tensors already load with `weights_only=True`.
"""

from __future__ import annotations

import io
import pickle
from typing import Any, BinaryIO

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem

METADATA_FILE = ".metadata"

_ALLOWED_MODULES = {
    # every class and enum DCP's Metadata is made of
    "torch.distributed.checkpoint.metadata",
    "torch.distributed.checkpoint._extension",
}
_ALLOWED_NAMES = {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"),
    ("torch", "Size"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
}


class UnsafeCheckpointError(pickle.UnpicklingError):
    """A checkpoint file refers to something that is not checkpoint data."""


class MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        allowed = (module in _ALLOWED_MODULES or (module, name) in _ALLOWED_NAMES
                   or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)))
        if not allowed:
            raise UnsafeCheckpointError(
                f"refusing to load {module}.{name}: DCP metadata never contains it")
        return super().find_class(module, name)


def load_metadata(stream: BinaryIO) -> Metadata:
    metadata = MetadataUnpickler(stream).load()
    if not isinstance(metadata, Metadata):
        raise UnsafeCheckpointError(f"{METADATA_FILE} holds a {type(metadata).__name__}, "
                                    f"not DCP Metadata")
    return metadata


class _SafeMetadata:
    """DCP's `read_metadata`, with the restricted unpickler for `.metadata`."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as f:
            metadata = load_metadata(f)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeFileSystemReader(_SafeMetadata, FileSystemReader):
    """DCP's local-path reader, loading nothing that runs code."""


class SafeFsspecReader(_SafeMetadata, FsspecReader):
    """DCP's fsspec reader (s3://, gs://, ...), loading nothing that runs code."""


def safe_reader(path: str, local: bool) -> FileSystemReader:
    return SafeFileSystemReader(path) if local else SafeFsspecReader(path)


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner with non-tensor items read as plain data only."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as err:
            raise UnsafeCheckpointError(
                f"refusing to load item {read_item.dest_index.fqn}: {err}".splitlines()[0]
            ) from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj

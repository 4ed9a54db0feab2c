"""Loading a checkpoint never runs code from it.

DCP reads `.metadata` with a plain `pickle.load` and every non-tensor item with
`torch.load(weights_only=False)`: a planted file in a checkpoint directory would execute on
resume. Here `.metadata` goes through an unpickler that admits an exact list of (module,
name) pairs, DCP's own metadata types and a few torch values, and never imports anything
(no dotted names, no import helpers, no persistent ids); non-tensor items go through
`torch.load(weights_only=True)` (plain data only: numbers, strings, lists, dicts, tuples,
tensors). Tensors already load with `weights_only=True`. A file refused here makes its
checkpoint incomplete: resume uses an older one, `verify` reports it, `export` refuses it.

An allowed name is still a live object of this process: pickle's BUILD opcode sets
attributes on whatever is on its stack, a class or a shared value (a dtype, an enum member)
included, so a file could rewrite the trainer's own classes. BUILD is therefore admitted
only on a record DCP writes (a new instance of one of its dataclasses, which nothing allowed
hands out ready-made) and only with the state that record's own pickling produces.
"""

from __future__ import annotations

import dataclasses
import io
import math
import pathlib
import pickle
from typing import Any, BinaryIO, Dict, List, Mapping, Optional

import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (_MEM_FORMAT_ENCODING, BytesStorageMetadata,
                                                     ChunkStorageMetadata, Metadata,
                                                     MetadataIndex, StorageMeta,
                                                     TensorProperties, TensorStorageMetadata)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.planner_helpers import _create_chunk_list
from torch.distributed.tensor import DTensor
from torch.futures import Future

from checkpointing.writer import RAW

METADATA_FILE = ".metadata"
# A ResNet-50's is ~100 KB and one of a large model sharded over a thousand ranks some tens of
# MB; unpickling inflates a file several times over, so a planted giant is refused unread.
MAX_METADATA_BYTES = 1 << 30


class UnsafeCheckpointError(pickle.UnpicklingError):
    """A checkpoint file refers to something that is not checkpoint data."""


def _shown(text: str) -> str:
    """A name from the file as one short printable line (it may hold anything)."""
    return ascii(text[:100])[1:-1] if isinstance(text, str) else type(text).__name__


def _layout_named(name: str) -> torch.layout:
    """What `torch.serialization._get_layout` does for the layouts a tensor can have."""
    layout = _LAYOUTS.get(name) if isinstance(name, str) else None
    if layout is None:
        raise UnsafeCheckpointError(f"refusing layout {_shown(name)}: not a torch layout")
    return layout


_LAYOUTS = {str(v): v for v in vars(torch).values() if isinstance(v, torch.layout)}
# Exactly the (module, name) pairs the `.metadata` of torch 2.14's DCP refers to, collected
# from real checkpoints (single process, DDP and FSDP trainers; model, optimizer, scheduler
# and plain Python state; every dtype), each mapped to its object so that nothing is ever
# imported or looked up by a name the file supplies. Everything else is refused: a pickle
# resolves dotted names through a module's own imports, so allowing a whole module would
# allow everything it imports.
_ALLOWED = {
    **{("torch.distributed.checkpoint.metadata", cls.__name__): cls
       for cls in (Metadata, StorageMeta, MetadataIndex, BytesStorageMetadata,
                   ChunkStorageMetadata, TensorProperties, TensorStorageMetadata,
                   _MEM_FORMAT_ENCODING)},
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): _StorageInfo,
    ("torch.serialization", "_get_layout"): _layout_named,
    ("torch", "Size"): torch.Size,
    ("pathlib", "PosixPath"): pathlib.PosixPath,  # StorageMeta.checkpoint_id
    **{("torch", name): v for name, v in vars(torch).items() if isinstance(v, torch.dtype)},
}


# DCP's records: their state is their fields' values, or whatever their own `__setstate__`
# takes (TensorProperties), and each instance of them here was made by this load.
_RECORDS = {cls: frozenset(f.name for f in dataclasses.fields(cls))
            for cls in (Metadata, StorageMeta, MetadataIndex, BytesStorageMetadata,
                        ChunkStorageMetadata, TensorProperties, TensorStorageMetadata,
                        _StorageInfo)}


# The pure-Python unpickler, because the C one's BUILD cannot be intercepted; on a 14 MB
# `.metadata` (20,000 sharded tensors) it takes twice as long, a few seconds once per resume.
class MetadataUnpickler(pickle._Unpickler):  # type: ignore[name-defined]
    dispatch = dict(pickle._Unpickler.dispatch)  # type: ignore[attr-defined]

    def load_build(self) -> None:
        state = self.stack.pop()
        inst = self.stack[-1]
        cls = type(inst)
        if cls not in _RECORDS:
            raise UnsafeCheckpointError(f"refusing to set the state of a {_shown(cls.__name__)}:"
                                        f" DCP metadata only sets it on its own records")
        # The class's `__setstate__`, never one the file put on the instance.
        setstate = vars(cls).get("__setstate__")
        if setstate is not None:
            setstate(inst, state)
        elif isinstance(state, dict) and all(key in _RECORDS[cls] for key in state):
            inst.__dict__.update(state)
        else:
            raise UnsafeCheckpointError(f"refusing a {cls.__name__} state that is not its "
                                        f"fields")

    dispatch[pickle.BUILD[0]] = load_build

    def find_class(self, module: str, name: str) -> Any:
        try:
            return _ALLOWED[(module, name)]
        except (KeyError, TypeError):
            raise UnsafeCheckpointError(f"refusing to load {_shown(module)}.{_shown(name)}: "
                                        f"DCP metadata never contains it") from None

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafeCheckpointError("refusing a persistent id: DCP metadata never holds one")


def _check_structure(metadata: Any) -> None:
    """The parts of `Metadata` that loading and verifying read have the types they need,
    so a forged one is refused here rather than failing somewhere deep inside DCP."""
    if not isinstance(metadata, Metadata):
        raise UnsafeCheckpointError(f"{METADATA_FILE} holds a {type(metadata).__name__}, "
                                    f"not DCP Metadata")
    entries = metadata.state_dict_metadata
    if not isinstance(entries, dict) or not all(
            isinstance(k, str) and (isinstance(v, BytesStorageMetadata) or (
                isinstance(v, TensorStorageMetadata) and isinstance(v.size, torch.Size)
                and isinstance(v.properties, TensorProperties)
                and isinstance(v.properties.dtype, torch.dtype)
                and isinstance(v.chunks, list)
                and all(isinstance(c, ChunkStorageMetadata) for c in v.chunks)))
            for k, v in entries.items()):
        raise UnsafeCheckpointError(f"{METADATA_FILE}: malformed state_dict_metadata")
    storage = metadata.storage_data
    if storage is not None and not (isinstance(storage, dict) and all(
            isinstance(k, MetadataIndex) and isinstance(v, _StorageInfo)
            and isinstance(v.relative_path, str) for k, v in storage.items())):
        raise UnsafeCheckpointError(f"{METADATA_FILE}: malformed storage_data")


def load_metadata(stream: BinaryIO) -> Metadata:
    """DCP `Metadata` from `stream`, or `UnsafeCheckpointError` when the file refers to
    anything else, is shaped unlike it or is too big; a damaged file raises whatever the
    unpickler raises. Nothing the file names is imported or called but `_ALLOWED`."""
    data = stream.read(MAX_METADATA_BYTES + 1)
    if len(data) > MAX_METADATA_BYTES:
        raise UnsafeCheckpointError(f"{METADATA_FILE} is over {MAX_METADATA_BYTES >> 20} MB: "
                                    f"not DCP metadata")
    metadata = MetadataUnpickler(io.BytesIO(data)).load()
    _check_structure(metadata)
    return metadata


class _SafeMetadata:
    """DCP's `read_metadata`, with the restricted unpickler for `.metadata`."""

    # No `rank` parameter: DCP then never falls back to per-rank metadata files, which no
    # commit marker signs.
    def read_metadata(self) -> Metadata:
        path = self._get_metadata_path()
        with self.fs.create_stream(path, "rb") as f:
            metadata = load_metadata(f)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class _RawTensors:
    """Reads the tensors `checkpointing.writer` stored as raw bytes straight into a tensor
    of the dtype and chunk shape `.metadata` gives (no unpickling); any other item goes
    through DCP's own `read_data`."""

    def set_up_storage_reader(self, metadata: Metadata, *args: Any, **kwargs: Any) -> None:
        super().set_up_storage_reader(metadata, *args, **kwargs)  # type: ignore[misc]
        self.tensors = metadata.state_dict_metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        raw: Dict[str, List[ReadItem]] = {}
        rest = []
        for item in plan.items:
            info = self.storage_data[item.storage_index]  # type: ignore[attr-defined]
            if tuple(info.transform_descriptors or ()) == (RAW,):
                raw.setdefault(info.relative_path, []).append(item)
            else:
                rest.append(item)
        for relative_path, items in raw.items():
            path = self.fs.concat_path(self.path, relative_path)  # type: ignore[attr-defined]
            with self.fs.create_stream(path, "rb") as stream:  # type: ignore[attr-defined]
                size = stream.seek(0, io.SEEK_END)
                for item in sorted(items, key=lambda i: self.storage_data[  # type: ignore
                        i.storage_index].offset):
                    self._load_raw(stream, size, item, planner)
        return super().read_data(  # type: ignore[misc]
            dataclasses.replace(plan, items=rest), planner)

    def _load_raw(self, stream: BinaryIO, size: int, item: ReadItem,
                  planner: LoadPlanner) -> None:
        info = self.storage_data[item.storage_index]  # type: ignore[attr-defined]
        if not 0 <= info.offset <= info.offset + info.length <= size:
            # checked before allocating: a forged length must not claim a terabyte
            raise UnsafeCheckpointError(f"{_shown(item.storage_index.fqn)}: bytes "
                                        f"{info.offset} to {info.offset + info.length} are not "
                                        f"within {_shown(info.relative_path)} ({size} bytes)")
        chunk = self._empty_chunk(item, info.length)
        stream.seek(info.offset)
        _read_exactly(stream, memoryview(chunk.reshape(-1).view(torch.uint8).numpy()),
                      item.storage_index.fqn)
        tensor = narrow_tensor_by_index(chunk, item.storage_offsets, item.lengths)
        target = planner.resolve_tensor(item).detach()
        if target.size() != tensor.size():
            raise UnsafeCheckpointError(f"{_shown(item.storage_index.fqn)}: the checkpoint "
                                        f"holds {list(tensor.size())}, the model "
                                        f"{list(target.size())}")
        target.copy_(tensor)
        planner.commit_tensor(item, target)

    def _empty_chunk(self, item: ReadItem, length: int) -> torch.Tensor:
        """An uninitialised tensor of the stored chunk `item` reads from (its shape and dtype
        checked against its length first)."""
        index = item.storage_index
        entry = self.tensors.get(index.fqn)
        chunks = [c for c in getattr(entry, "chunks", ())
                  if list(c.offsets) == list(index.offset or ())]
        if not isinstance(entry, TensorStorageMetadata) or not chunks:
            raise UnsafeCheckpointError(f"{METADATA_FILE} has no chunk of {_shown(index.fqn)}"
                                        f" at {list(index.offset or ())}")
        shape = [int(n) for n in chunks[0].sizes]
        itemsize = entry.properties.dtype.itemsize
        if min(shape, default=0) < 0 or math.prod(shape) * itemsize != length:
            raise UnsafeCheckpointError(f"{_shown(index.fqn)}: {length} bytes stored for a "
                                        f"{entry.properties.dtype} chunk of shape {shape}")
        return torch.empty(shape, dtype=entry.properties.dtype)


def _read_exactly(stream: BinaryIO, into: memoryview, name: str) -> None:
    done = 0
    while done < len(into):
        n = stream.readinto(into[done:])
        if not n:
            raise UnsafeCheckpointError(f"{_shown(name)}: the file ends {len(into) - done} "
                                        f"bytes short")
        done += n


class SafeFileSystemReader(_SafeMetadata, _RawTensors, FileSystemReader):
    """DCP's local-path reader, loading nothing that runs code."""


class SafeFsspecReader(_SafeMetadata, _RawTensors, FsspecReader):
    """DCP's fsspec reader (s3://, gs://, ...), loading nothing that runs code."""


def safe_reader(path: str, local: bool,
                storage_options: Optional[Mapping[str, Any]] = None) -> FileSystemReader:
    """`storage_options`: fsspec's, for a URL's filesystem."""
    return SafeFileSystemReader(path) if local else SafeFsspecReader(path,
                                                                      **(storage_options or {}))


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner with non-tensor items read as plain data only, and every element
    of every tensor it loads read from the checkpoint exactly once."""

    # DCP reads only where `.metadata`'s chunks meet the live tensor: chunks that leave a
    # gap (a forged size, a negative one) leave those elements as they were, the live
    # weights on resume and uninitialized memory in `export`, silently.
    def create_local_plan(self) -> LoadPlan:
        plan = super().create_local_plan()
        reads: Dict[tuple, List[ReadItem]] = {}
        for item in plan.items:
            if item.type == LoadItemType.TENSOR:
                reads.setdefault((item.dest_index.fqn, item.dest_index.index), []).append(item)
        for fqn, obj in self.state_dict.items():
            if not isinstance(self.metadata.state_dict_metadata.get(fqn),
                              TensorStorageMetadata) or (
                    isinstance(obj, DTensor) and obj.device_mesh.get_coordinate() is None):
                continue  # not loaded as a tensor here, or not this rank's
            for index, chunk in enumerate(_create_chunk_list(obj)):
                if not _read_exactly_once(chunk.sizes, reads.get((fqn, index), [])):
                    raise UnsafeCheckpointError(
                        f"{_shown(fqn)}: the chunks {METADATA_FILE} lists do not make up the "
                        f"tensor (gaps or overlaps): a damaged or forged checkpoint")
        return plan

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


def _read_exactly_once(sizes: torch.Size, items: List[ReadItem]) -> bool:
    """Whether `items` write every element of a tensor of `sizes` once and only once."""
    if len(items) == 1 and list(items[0].lengths) == list(sizes):
        return True  # the whole tensor from one chunk: the same sharding saved and loaded
    if sum(math.prod(item.lengths) for item in items) != math.prod(sizes):
        return False
    # As many elements read as the tensor has: they are all of them if no two reads meet.
    written = torch.zeros(sizes, dtype=torch.bool)
    for item in items:
        region = narrow_tensor_by_index(written, item.dest_offsets, item.lengths)
        if region.any():
            return False
        region.fill_(True)
    return True

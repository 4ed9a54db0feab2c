"""Loading a checkpoint never runs code from it.

DCP reads `.metadata` with a plain `pickle.load` and every non-tensor item with
`torch.load(weights_only=False)`: a planted file in a checkpoint directory would execute on
resume. Here `.metadata` goes through an unpickler that admits an exact list of (module,
name) pairs, DCP's own metadata types and a few torch values, and never imports anything
(no dotted names, no import helpers, no persistent ids); non-tensor items go through
`torch.load(weights_only=True)` (plain data only: numbers, strings, lists, dicts, tuples,
tensors). A tensor's bytes are read straight into the live tensor where its record is
plainly its bytes (`_DirectTensors`); any other tensor record loads with
`weights_only=True`, as in DCP. A file refused here makes its checkpoint incomplete: resume
uses an older one, `verify` reports it, `export` refuses it.

An allowed name is still a live object of this process: pickle's BUILD opcode sets
attributes on whatever is on its stack, a class or a shared value (a dtype, an enum member)
included, so a file could rewrite the trainer's own classes. BUILD is therefore admitted
only on a record DCP writes (a new instance of one of its dataclasses, which nothing allowed
hands out ready-made) and only with the state that record's own pickling produces.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import io
import math
import pathlib
import pickle
import struct
import sys
import zipfile
from typing import Any, BinaryIO, Dict, List, Mapping, Optional, Tuple

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


def shown(text: str) -> str:
    """A name from the file as one short printable line (it may hold anything)."""
    return ascii(text[:100])[1:-1] if isinstance(text, str) else type(text).__name__


def _layout_named(name: str) -> torch.layout:
    """What `torch.serialization._get_layout` does for the layouts a tensor can have."""
    layout = _LAYOUTS.get(name) if isinstance(name, str) else None
    if layout is None:
        raise UnsafeCheckpointError(f"refusing layout {shown(name)}: not a torch layout")
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


# Each record's own `__setstate__` (or None), never one the file put on an instance; looked
# up once (`vars(cls)` per BUILD took a third of a large `.metadata`'s unpickling).
_SETSTATE = {cls: vars(cls).get("__setstate__") for cls in _RECORDS}


def _allowed(module: str, name: str) -> Any:
    """Pickle's `find_class`: the object of an allowed (module, name) pair, nothing else."""
    try:
        return _ALLOWED[(module, name)]
    except (KeyError, TypeError):
        raise UnsafeCheckpointError(f"refusing to load {shown(module)}.{shown(name)}: "
                                    f"DCP metadata never contains it") from None


def _set_state(inst: Any, state: Any) -> None:
    """Pickle's BUILD, admitted only on DCP's records (`_RECORDS`) and only with the state
    their own pickling produces."""
    cls = type(inst)
    if cls not in _RECORDS:
        raise UnsafeCheckpointError(f"refusing to set the state of a {shown(cls.__name__)}:"
                                    f" DCP metadata only sets it on its own records")
    setstate = _SETSTATE[cls]
    if setstate is not None:
        setstate(inst, state)
    elif isinstance(state, dict) and all(key in _RECORDS[cls] for key in state):
        inst.__dict__.update(state)
    else:
        raise UnsafeCheckpointError(f"refusing a {cls.__name__} state that is not its "
                                    f"fields")


def _new(cls: Any, args: Any) -> Any:
    """Pickle's NEWOBJ, admitted only as DCP's records' own pickling uses it: a new record,
    no arguments (`cls.__new__(cls, *args)` copies a shared list each time: quadratic)."""
    # `type(cls)` first: a tuple's hash walks all it holds (`_key`)
    if type(cls) is not type or cls not in _RECORDS or args != ():
        name = getattr(cls, "__name__", type(cls).__name__)
        raise UnsafeCheckpointError(f"refusing to make a {shown(name)} that way: DCP "
                                    f"metadata only makes its records, bare")
    return cls.__new__(cls)


# What REDUCE may call: the values DCP's records hold (the classes of `_RECORDS` are built
# by NEWOBJ + BUILD, their own pickling, never by a call), by identity, as hashing what a
# file put on the stack is not bounded (`_key`).
_CALLS = {id(f): f for f in (torch.Size, _layout_named, pathlib.PosixPath,
                             _MEM_FORMAT_ENCODING)}
# A torch.Size's dims, a path's parts: more than any tensor or checkpoint path has. Each
# call is bounded because two bytes (BINGET) hand it the same list again and again: a 1 MB
# file of one list of a million dims, made a torch.Size a thousand times, took 8 GB.
_MAX_PARTS = 64
_MAX_PATH = 4096  # bytes, Linux's PATH_MAX


def _call(func: Any, args: Any) -> Any:
    """Pickle's REDUCE, of `_CALLS` only, each with the few small arguments DCP's pickling
    gives it: a tensor's dims, a path's parts, a layout's name, a memory format's number."""
    if _CALLS.get(id(func)) is not func or type(args) is not tuple:
        name = getattr(func, "__name__", type(func).__name__)
        raise UnsafeCheckpointError(f"refusing to call {shown(name)}: DCP metadata never "
                                    f"does")
    if func is torch.Size:
        fits = len(args) == 1 and type(args[0]) in (tuple, list) and len(args[0]) <= _MAX_PARTS
    elif func is pathlib.PosixPath:
        fits = (len(args) <= _MAX_PARTS and all(type(a) is str for a in args)
                and sum(map(len, args)) <= _MAX_PATH)
    elif func is _MEM_FORMAT_ENCODING:  # looked up by hashing its value
        fits = len(args) == 1 and type(args[0]) is int and args[0].bit_length() < 64
    else:
        fits = True  # _layout_named: checks its argument itself
    value = func(*args) if fits else None
    if not fits or (func is pathlib.PosixPath and len(value.parts) > _MAX_PARTS):
        raise UnsafeCheckpointError(f"refusing a {shown(func.__name__)} of other arguments "
                                    f"than DCP's (a few small values)")
    return value


def _key(key: Any) -> Any:
    """A dict key as DCP's are, a name or a `MetadataIndex` of one, since
    storing it hashes it: a tuple's hash walks all it holds, and takes 2^60 steps for sixty
    nested pairs of a few bytes each (BINGET twice, TUPLE2), or overflows the C stack for a
    million nested tuples."""
    if type(key) is str or (type(key) is MetadataIndex
                            and type(getattr(key, "fqn", None)) is str
                            and type(getattr(key, "offset", None)) in (torch.Size, type(None))):
        return key  # a torch.Size is at most _MAX_PARTS ints (`_call`)
    raise UnsafeCheckpointError(f"refusing a {shown(type(key).__name__)} as a key: DCP "
                                f"metadata's keys are names and MetadataIndex")


# The pure-Python unpickler, because the C one's BUILD cannot be intercepted (and the C
# one's memo takes a list as long as the largest index a file names: 32 GB for a 10-byte
# file). `_parse_common` reads the opcodes DCP's pickles use under the same rules, faster;
# this one reads whatever else a file holds, as the standard library reads it.
class MetadataUnpickler(pickle._Unpickler):  # type: ignore[name-defined]
    dispatch = dict(pickle._Unpickler.dispatch)  # type: ignore[attr-defined]

    def load_build(self) -> None:
        state = self.stack.pop()
        _set_state(self.stack[-1], state)

    dispatch[pickle.BUILD[0]] = load_build

    def find_class(self, module: str, name: str) -> Any:
        return _allowed(module, name)

    # Calls and hashing under `_new`, `_call` and `_key`, as in `_parse_common`.
    def load_reduce(self) -> None:
        args = self.stack.pop()
        self.stack[-1] = _call(self.stack[-1], args)

    dispatch[pickle.REDUCE[0]] = load_reduce

    def load_newobj(self) -> None:
        args = self.stack.pop()
        self.stack[-1] = _new(self.stack[-1], args)

    dispatch[pickle.NEWOBJ[0]] = load_newobj

    def load_newobj_ex(self) -> None:
        kwargs = self.stack.pop()
        args = self.stack.pop()
        self.stack[-1] = _new(self.stack[-1], args if kwargs == {} else None)

    dispatch[pickle.NEWOBJ_EX[0]] = load_newobj_ex

    def _instantiate(self, klass: Any, args: List[Any]) -> None:  # OBJ and INST
        self.append(_call(klass, tuple(args)) if args or not isinstance(klass, type)
                    else _new(klass, ()))

    def load_setitem(self) -> None:
        value = self.stack.pop()
        key = self.stack.pop()
        self.stack[-1][_key(key)] = value

    dispatch[pickle.SETITEM[0]] = load_setitem

    def load_setitems(self) -> None:
        items = self.pop_mark()
        target = self.stack[-1]
        for i in range(0, len(items), 2):
            target[_key(items[i])] = items[i + 1]

    dispatch[pickle.SETITEMS[0]] = load_setitems

    def load_dict(self) -> None:
        items = self.pop_mark()
        self.append({_key(items[i]): items[i + 1] for i in range(0, len(items), 2)})

    dispatch[pickle.DICT[0]] = load_dict

    def load_set(self) -> None:  # ADDITEMS and FROZENSET hash their items
        raise UnsafeCheckpointError("refusing a set: DCP metadata never holds one")

    dispatch[pickle.ADDITEMS[0]] = load_set
    dispatch[pickle.FROZENSET[0]] = load_set

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafeCheckpointError("refusing a persistent id: DCP metadata never holds one")


class _Uncommon(Exception):
    """`_parse_common` met what DCP's own pickling never writes, or a damaged file."""


_UNPACK_I4 = struct.Struct("<i").unpack_from
_UNPACK_U4 = struct.Struct("<I").unpack_from
_UNPACK_U2 = struct.Struct("<H").unpack_from
_UNPACK_F8 = struct.Struct(">d").unpack_from
_UNPACK_U8 = struct.Struct("<Q").unpack_from
_NO_FRAME = sys.maxsize


def _parse_common(data: bytes) -> Any:
    """The object pickled in `data`, for the opcodes `pickle.dumps` (protocols 2-5) writes
    for DCP's `Metadata`, each with exactly the standard unpickler's meaning; `_Uncommon`
    at anything else (another opcode, a call or container it would not make, damage), for
    `MetadataUnpickler` to read from the start. The same rules as it (`_allowed`,
    `_set_state`, `_new`, `_call`, `_key`), in one loop over the bytes: 1.6x faster than
    the pure-Python unpickler (both with the collector paused), whose dispatch costs
    several calls per opcode. The memo is a dict, so an index costs
    what it holds, never what its number says."""
    stack: List[Any] = []
    marks: List[List[Any]] = []
    memo: Dict[int, Any] = {}
    push = stack.append
    i = 0
    frame_end = _NO_FRAME  # where the current FRAME ends
    while True:
        if i >= frame_end:  # out of the frame: the op that got here must not straddle its end
            if i > frame_end:
                raise _Uncommon
            frame_end = _NO_FRAME
        op = data[i]
        i += 1
        if op == 0x94:  # MEMOIZE
            memo[len(memo)] = stack[-1]
        elif op == 0x6a:  # LONG_BINGET
            push(memo[_UNPACK_U4(data, i)[0]])
            i += 4
        elif op == 0x68:  # BINGET
            push(memo[data[i]])
            i += 1
        elif op == 0x85:  # TUPLE1
            stack[-1] = (stack[-1],)
        elif op == 0x4b:  # BININT1
            push(data[i])
            i += 1
        elif op == 0x28:  # MARK
            marks.append(stack)
            stack = []
            push = stack.append
        elif op == 0x29:  # EMPTY_TUPLE
            push(())
        elif op == 0x81:  # NEWOBJ
            args = stack.pop()
            stack[-1] = _new(stack[-1], args)
        elif op == 0x62:  # BUILD
            state = stack.pop()
            _set_state(stack[-1], state)
        elif op == 0x7d:  # EMPTY_DICT
            push({})
        elif op == 0x75:  # SETITEMS
            items = stack
            stack = marks.pop()
            push = stack.append
            target = stack[-1]
            if type(target) is not dict or len(items) % 2:
                raise _Uncommon
            for k in range(0, len(items), 2):
                key = items[k]
                target[key if type(key) is str else _key(key)] = items[k + 1]
        elif op == 0x73:  # SETITEM
            value = stack.pop()
            key = stack.pop()
            if type(stack[-1]) is not dict:
                raise _Uncommon
            stack[-1][_key(key)] = value
        elif op == 0x52:  # REDUCE
            args = stack.pop()
            stack[-1] = _call(stack[-1], args)
        elif op == 0x8c:  # SHORT_BINUNICODE
            n = data[i]
            i += 1
            push(str(data[i:i + n], "utf-8", "surrogatepass"))
            i += n
        elif op == 0x74:  # TUPLE
            items = stack
            stack = marks.pop()
            push = stack.append
            push(tuple(items))
        elif op == 0x89:  # NEWFALSE
            push(False)
        elif op == 0x88:  # NEWTRUE
            push(True)
        elif op == 0x4d:  # BININT2
            push(_UNPACK_U2(data, i)[0])
            i += 2
        elif op == 0x4a:  # BININT
            push(_UNPACK_I4(data, i)[0])
            i += 4
        elif op == 0x5d:  # EMPTY_LIST
            push([])
        elif op == 0x61:  # APPEND
            value = stack.pop()
            if type(stack[-1]) is not list:
                raise _Uncommon
            stack[-1].append(value)
        elif op == 0x65:  # APPENDS
            items = stack
            stack = marks.pop()
            push = stack.append
            if type(stack[-1]) is not list:
                raise _Uncommon
            stack[-1].extend(items)
        elif op == 0x86:  # TUPLE2
            stack[-2:] = [(stack[-2], stack[-1])]
        elif op == 0x87:  # TUPLE3
            stack[-3:] = [(stack[-3], stack[-2], stack[-1])]
        elif op == 0x4e:  # NONE
            push(None)
        elif op == 0x93:  # STACK_GLOBAL
            name = stack.pop()
            module = stack.pop()
            if type(name) is not str or type(module) is not str:
                raise _Uncommon
            push(_allowed(module, name))
        elif op == 0x58:  # BINUNICODE
            n = _UNPACK_U4(data, i)[0]
            i += 4
            if i + n > len(data):
                raise _Uncommon
            push(str(data[i:i + n], "utf-8", "surrogatepass"))
            i += n
        elif op == 0x8a:  # LONG1
            n = data[i]
            i += 1
            push(int.from_bytes(data[i:i + n], "little", signed=True))
            i += n
        elif op == 0x47:  # BINFLOAT
            push(_UNPACK_F8(data, i)[0])
            i += 8
        elif op == 0x71:  # BINPUT
            memo[data[i]] = stack[-1]
            i += 1
        elif op == 0x72:  # LONG_BINPUT
            memo[_UNPACK_U4(data, i)[0]] = stack[-1]
            i += 4
        elif op == 0x95:  # FRAME: where the next ops end; a new one only after it
            if frame_end != _NO_FRAME:
                raise _Uncommon
            frame_end = i + 8 + _UNPACK_U8(data, i)[0]
            i += 8
            if frame_end > len(data):
                raise _Uncommon
        elif op == 0x80:  # PROTO
            if not 2 <= data[i] <= pickle.HIGHEST_PROTOCOL:
                raise _Uncommon
            i += 1
        elif op == 0x2e:  # STOP
            if len(stack) != 1 or marks:
                raise _Uncommon
            return stack[0]
        else:
            raise _Uncommon


def _unpickled(data: bytes) -> Any:
    """The object in the `.metadata` bytes `data`, under `MetadataUnpickler`'s rules.

    With the cyclic garbage collector paused: the records are a few objects each, acyclic,
    and hundreds of thousands of them at scale, so its passes over a growing heap took more
    than half of the time (0.7 s of 1.4 s for a 4.5 MB file with pickle's C unpickler)."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        try:
            return _parse_common(data)
        except UnsafeCheckpointError:
            raise
        except Exception:  # _Uncommon, or damage: the reference reads it, and names the damage
            pass  # after this block: its traceback holds all the fast path built (2x the memory)
        return MetadataUnpickler(io.BytesIO(data)).load()
    finally:
        if collecting:
            gc.enable()


def _check_structure(metadata: Any) -> None:
    """The parts of `Metadata` that loading and verifying read have the types they need,
    so a forged one is refused here rather than failing somewhere deep inside DCP."""
    if not isinstance(metadata, Metadata):
        raise UnsafeCheckpointError(f"{METADATA_FILE} holds a {type(metadata).__name__}, "
                                    f"not DCP Metadata")
    entries = metadata.state_dict_metadata
    # DCP gives each tensor a record and a chunk list of its own. Shared by many names
    # (BINGET: two bytes each), one list of 100,000 chunks under 4,000 names (240 KB) took
    # 36 s to check here, a 2 MB file hours, and DCP's planning walks each tensor's list.
    tensors = ([v for v in entries.values() if isinstance(v, TensorStorageMetadata)]
               if isinstance(entries, dict) else [])
    if len({id(part) for v in tensors for part in (v, getattr(v, "chunks", None))}
           ) != 2 * len(tensors):
        raise UnsafeCheckpointError(f"{METADATA_FILE}: tensors share their records")
    if not isinstance(entries, dict) or not all(
            isinstance(k, str) and (isinstance(v, BytesStorageMetadata) or (
                isinstance(v, TensorStorageMetadata) and isinstance(v.size, torch.Size)
                and isinstance(v.properties, TensorProperties)
                and isinstance(v.properties.dtype, torch.dtype)
                and isinstance(v.chunks, list)
                and all(isinstance(c, ChunkStorageMetadata) for c in v.chunks)))
            for k, v in entries.items()):
        raise UnsafeCheckpointError(f"{METADATA_FILE}: malformed state_dict_metadata")
    # DCP's reader sets `load_id` on it: were it an allowed class, function or enum member,
    # that would be set on the trainer's own for the rest of the process
    if metadata.storage_meta is not None and not isinstance(metadata.storage_meta,
                                                            StorageMeta):
        raise UnsafeCheckpointError(f"{METADATA_FILE}: malformed storage_meta")
    storage = metadata.storage_data
    if storage is not None and not (isinstance(storage, dict) and all(
            isinstance(k, MetadataIndex) and isinstance(v, _StorageInfo)
            and isinstance(v.relative_path, str) for k, v in storage.items())):
        raise UnsafeCheckpointError(f"{METADATA_FILE}: malformed storage_data")


def load_metadata(stream: BinaryIO, reuse: bool = False) -> Metadata:
    """DCP `Metadata` from `stream`, or `UnsafeCheckpointError` when the file refers to
    anything else, is shaped unlike it or is too big; a damaged file raises whatever the
    unpickler raises. Nothing the file names is imported or called but `_ALLOWED`.

    `reuse`: when these bytes are those parsed last with `reuse`, that same object (for
    callers that do not change it): a resume verifies a checkpoint, then loads it, and the
    restricted unpickler is slow (0.03 s for ResNet-50 + AdamW on an idle core, seconds for a
    large sharded model).
    """
    global _last_parsed
    data = stream.read(MAX_METADATA_BYTES + 1)
    if len(data) > MAX_METADATA_BYTES:
        raise UnsafeCheckpointError(f"{METADATA_FILE} is over {MAX_METADATA_BYTES >> 20} MB: "
                                    f"not DCP metadata")
    last = _last_parsed
    if reuse and last is not None and last[0] == data:
        return last[1]
    metadata = _unpickled(data)
    _check_structure(metadata)
    if reuse:
        _last_parsed = (data, metadata)
    return metadata


_last_parsed: Optional[Tuple[bytes, Metadata]] = None


def forget_parsed() -> None:
    """Let go of the `.metadata` kept for `reuse`, once the load it served is done: it grows
    as tensors x ranks (1.2 KB a pair: over a GB per rank for 1 B parameters on 1,024 ranks)
    and would otherwise be held for the rest of the run."""
    global _last_parsed
    _last_parsed = None


class _SafeMetadata:
    """DCP's `read_metadata`, with the restricted unpickler for `.metadata`."""

    # No `rank` parameter: DCP then never falls back to per-rank metadata files, which no
    # commit marker signs.
    def read_metadata(self) -> Metadata:
        path = self._get_metadata_path()
        with self.fs.create_stream(path, "rb") as f:
            metadata = load_metadata(f, reuse=True)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class _DirectTensors:
    """Reads each tensor's stored bytes straight into the live tensor (or, when that is not
    a plain CPU tensor of the stored chunk's dtype and shape, into a chunk copied from),
    unpickling nothing: the bytes of a `RAW` record, or those of a standard record (a
    `torch.save` archive of one tensor) whose archive is exactly what `torch.save` writes
    for a contiguous tensor of the dtype and chunk shape `.metadata` gives, as
    `checkpointing.writer` writes them. Any other standard record (a strided or quantized
    tensor, another writer's pickle) is read as DCP's own reader does, with
    `torch.load(weights_only=True)` on its bounded slice, and must then hold a tensor of
    that dtype and shape. Non-tensor items go through DCP's `read_data` (and
    `SafeLoadPlanner.load_bytes`)."""

    def set_up_storage_reader(self, metadata: Metadata, *args: Any, **kwargs: Any) -> None:
        super().set_up_storage_reader(metadata, *args, **kwargs)  # type: ignore[misc]
        self.tensors = metadata.state_dict_metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        tensors: Dict[str, List[ReadItem]] = {}
        rest = []
        for item in plan.items:
            info = self.storage_data[item.storage_index]  # type: ignore[attr-defined]
            if item.type == LoadItemType.TENSOR and tuple(
                    info.transform_descriptors or ()) in ((RAW,), ()):
                tensors.setdefault(info.relative_path, []).append(item)
            else:
                rest.append(item)
        for relative_path, items in tensors.items():
            path = self.fs.concat_path(self.path, relative_path)  # type: ignore[attr-defined]
            with self.fs.create_stream(path, "rb") as stream:  # type: ignore[attr-defined]
                size = stream.seek(0, io.SEEK_END)
                for item in sorted(items, key=lambda i: self.storage_data[  # type: ignore
                        i.storage_index].offset):
                    self._load_tensor(stream, size, item, planner)
        return super().read_data(  # type: ignore[misc]
            dataclasses.replace(plan, items=rest), planner)

    def _load_tensor(self, stream: BinaryIO, size: int, item: ReadItem,
                     planner: LoadPlanner) -> None:
        info = self.storage_data[item.storage_index]  # type: ignore[attr-defined]
        fqn = item.storage_index.fqn
        if not 0 <= info.offset <= info.offset + info.length <= size:
            # checked before allocating: a forged length must not claim a terabyte
            raise UnsafeCheckpointError(f"{shown(fqn)}: bytes {info.offset} to "
                                        f"{info.offset + info.length} are not within "
                                        f"{shown(info.relative_path)} ({size} bytes)")
        dtype, shape = self._stored_chunk(item)
        target = planner.resolve_tensor(item).detach()
        span = ((info.offset, info.length) if info.transform_descriptors  # RAW
                else _archived_bytes(stream, info, dtype, shape))
        if span is None:
            chunk = _unarchived(stream, info, fqn, dtype, shape)
        else:
            start, length = span
            if math.prod(shape) * dtype.itemsize != length:
                raise UnsafeCheckpointError(f"{shown(fqn)}: {length} bytes stored for a "
                                            f"{dtype} chunk of shape {shape}")
            whole = (list(item.lengths) == shape and not any(item.storage_offsets)
                     and list(target.size()) == shape)
            chunk = (target if whole and _plain(target, dtype)
                     else torch.empty(shape, dtype=dtype))
            stream.seek(start)
            _read_exactly(stream, memoryview(chunk.reshape(-1).view(torch.uint8).numpy()), fqn)
        if chunk is not target:
            tensor = narrow_tensor_by_index(chunk, item.storage_offsets, item.lengths)
            if target.size() != tensor.size():
                raise UnsafeCheckpointError(f"{shown(fqn)}: the checkpoint holds "
                                            f"{list(tensor.size())}, the model "
                                            f"{list(target.size())}")
            target.copy_(tensor)
        planner.commit_tensor(item, target)

    def _stored_chunk(self, item: ReadItem) -> Tuple[torch.dtype, List[int]]:
        """The dtype and shape `.metadata` gives the stored chunk `item` reads from."""
        index = item.storage_index
        entry = self.tensors.get(index.fqn)
        chunks = [c for c in getattr(entry, "chunks", ())
                  if list(c.offsets) == list(index.offset or ())]
        if not isinstance(entry, TensorStorageMetadata) or not chunks:
            raise UnsafeCheckpointError(f"{METADATA_FILE} has no chunk of {shown(index.fqn)}"
                                        f" at {list(index.offset or ())}")
        shape = [int(n) for n in chunks[0].sizes]
        if min(shape, default=0) < 0:
            raise UnsafeCheckpointError(f"{shown(index.fqn)}: a chunk of shape {shape}")
        return entry.properties.dtype, shape


def _plain(tensor: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether the stored bytes of a `dtype` chunk can be read into `tensor`'s memory."""
    return (type(tensor) is torch.Tensor and tensor.device.type == "cpu"
            and tensor.dtype == dtype and tensor.layout == torch.strided
            and not tensor.is_quantized and tensor.is_contiguous()
            and not tensor.is_conj() and not tensor.is_neg())


def _unarchived(stream: BinaryIO, info: _StorageInfo, fqn: str, dtype: torch.dtype,
                shape: List[int]) -> torch.Tensor:
    """The tensor in the standard record `info` (within the file: checked), loaded as DCP's
    reader loads it, which must be a `dtype` chunk of `shape` as `.metadata` says."""
    stream.seek(info.offset)
    record = stream.read(info.length)
    if len(record) != info.length:
        raise UnsafeCheckpointError(f"{shown(fqn)}: the file ends "
                                    f"{info.length - len(record)} bytes short")
    try:
        # torch checks each storage's size against its record before allocating it
        tensor = torch.load(io.BytesIO(record), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        raise UnsafeCheckpointError(
            f"refusing to load item {shown(fqn)}: {err}".splitlines()[0]) from None
    if not isinstance(tensor, torch.Tensor) or tensor.dtype != dtype or (
            list(tensor.size()) != shape):
        held = (f"a {tensor.dtype} tensor of shape {list(tensor.size())}"
                if isinstance(tensor, torch.Tensor) else f"a {type(tensor).__name__}")
        raise UnsafeCheckpointError(f"{shown(fqn)}: its record holds {held}, "
                                    f"{METADATA_FILE} a {dtype} chunk of shape {shape}")
    return tensor


# Zip records (little-endian): the local header before an entry's bytes (signature, then
# its name and extra field lengths at 26), the central directory's entry (method, sizes,
# name, extra and comment lengths, offset of the local header) and its end record (entries,
# directory size and offset). torch.save writes entry sizes only in the directory.
_LOCAL = struct.Struct("<4s22xHH")
_ENTRY = struct.Struct("<4s6xH8xIIHHH8xI")
_END = struct.Struct("<4s6xHII2x")
_NO_SIZE = 0xFFFFFFFF  # the field's value in a zip64 archive (over 4 GB): not read here
# torch.save's records before a tensor's bytes (pickle, format version, alignment, byte
# order) and its directory after them each take under a kilobyte.
_HEAD = 4096


def _archived_bytes(stream: BinaryIO, info: _StorageInfo, dtype: torch.dtype,
                    shape: List[int]) -> Optional[Tuple[int, int]]:
    """(offset in the file, length) of the tensor bytes in the standard record `info`, when
    its archive is exactly `torch.save`'s of a contiguous `dtype` tensor of `shape` (the
    same pickle, this machine's byte order, its one storage stored uncompressed, every
    entry within the record); else None. Only the record's head and its zip directory are
    read, and nothing is unpickled. (No CRC32 is checked: `checkpointing.writer` leaves them
    out, torch.load does not check them, and every file's checksum is verified before a
    load.)"""
    stream.seek(info.offset)
    if info.length <= 2 * _HEAD:  # most records (biases, norms, step counts): one read
        head = tail = stream.read(info.length)
        tail_at = 0
    else:
        head = stream.read(_HEAD)
        tail_at = info.length - _HEAD
        stream.seek(info.offset + tail_at)
        tail = stream.read(_HEAD)
    if len(tail) < _END.size:
        return None
    signature, count, size, offset = _END.unpack_from(tail, len(tail) - _END.size)
    start = offset - tail_at
    if (signature != b"PK\x05\x06" or offset == _NO_SIZE or start < 0
            or start + size > len(tail) - _END.size):
        return None
    spans: Dict[bytes, Tuple[int, int]] = {}  # entry name -> (offset of its local header, size)
    for _ in range(count):
        if start + _ENTRY.size > len(tail):
            return None
        (signature, method, stored, length, name_length, extra_length, comment_length,
         local) = _ENTRY.unpack_from(tail, start)
        if signature != b"PK\x01\x02":
            return None
        name = tail[start + _ENTRY.size:start + _ENTRY.size + name_length]
        if method == zipfile.ZIP_STORED and stored == length != _NO_SIZE:
            spans[name.partition(b"/")[2]] = (local, length)
        start += _ENTRY.size + name_length + extra_length + comment_length
    if (b"data/0" not in spans or sum(n.startswith(b"data/") for n in spans) != 1
            or spans[b"data/0"][1] != math.prod(shape) * dtype.itemsize):
        return None
    template = _tensor_pickle(dtype, tuple(shape))  # of the size of data/0's: bounded
    for name, expected in ((b"data.pkl", template), (b"byteorder", sys.byteorder.encode())):
        local, length = spans.get(name, (len(head), -1))
        begin = _entry_start(head, local)
        if (expected is None or begin is None or length != len(expected)
                or head[begin:begin + length] != expected):
            return None
    local, length = spans[b"data/0"]
    begin = _entry_start(head, local)  # its header follows the small records: in the head
    if begin is None:
        stream.seek(info.offset + local)
        begin = _entry_start(stream.read(_LOCAL.size), 0)
        begin = None if begin is None else local + begin
    if begin is None or begin + length > info.length:
        return None
    return info.offset + begin, length


def _entry_start(data: bytes, local: int) -> Optional[int]:
    """Where the bytes of the entry whose local header is at `local` in `data` begin (as
    an offset from the start of `data`); None when no local header is there."""
    if local + _LOCAL.size > len(data):
        return None
    signature, name_length, extra_length = _LOCAL.unpack_from(data, local)
    return (local + _LOCAL.size + name_length + extra_length
            if signature == b"PK\x03\x04" else None)


@functools.lru_cache(maxsize=4096)
def _tensor_pickle(dtype: torch.dtype, shape: Tuple[int, ...]) -> Optional[bytes]:
    """The `data.pkl` that `torch.save` writes for a contiguous `dtype` tensor of `shape`
    that is all of its storage (what `checkpointing.writer` stores); None for a dtype no
    plain tensor has. The tensor is allocated, never filled or written."""
    buffer = io.BytesIO()
    try:
        with torch.serialization.skip_data():
            torch.save(torch.empty(shape, dtype=dtype), buffer)
    except (RuntimeError, TypeError):  # quantized and bit-packed dtypes
        return None
    with zipfile.ZipFile(buffer) as archive:
        return archive.read(next(n for n in archive.namelist() if n.endswith("/data.pkl")))


def _read_exactly(stream: BinaryIO, into: memoryview, name: str) -> None:
    done = 0
    while done < len(into):
        n = stream.readinto(into[done:])
        if not n:
            raise UnsafeCheckpointError(f"{shown(name)}: the file ends {len(into) - done} "
                                        f"bytes short")
        done += n


class SafeFileSystemReader(_SafeMetadata, _DirectTensors, FileSystemReader):
    """DCP's local-path reader, loading nothing that runs code."""


class SafeFsspecReader(_SafeMetadata, _DirectTensors, FsspecReader):
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
            # a plain tensor is one chunk, itself (DCP's protocol checks cost 0.02 s a load)
            sizes = ([obj.size()] if type(obj) in (torch.Tensor, torch.nn.Parameter)
                     else [chunk.sizes for chunk in _create_chunk_list(obj)])
            for index, size in enumerate(sizes):
                if not _read_exactly_once(size, reads.get((fqn, index), [])):
                    raise UnsafeCheckpointError(
                        f"{shown(fqn)}: the chunks {METADATA_FILE} lists do not make up the "
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

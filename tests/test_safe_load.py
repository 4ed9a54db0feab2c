"""A hostile checkpoint folder never runs code, hangs or exhausts memory, whichever pickle
opcode, protocol or name it uses, on resume, in `checkpointing.verify` and in
`checkpointing.export`; what it holds is a damaged checkpoint, skipped with one line.

Every payload would make a directory (`pwned`) if any part of it ran, so "nothing ran" is
checked by that directory's absence, not by an error message alone."""

from __future__ import annotations

import copyreg
import gc
import io
import json
import logging
import os
import pathlib
import pickle
import random
import shutil
import struct
import sys
import tracemalloc
import zipfile
from pathlib import Path
from typing import Callable, List, Tuple

import pytest
import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata,
                                                     Metadata, MetadataIndex, StorageMeta,
                                                     TensorProperties, TensorStorageMetadata)
from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

from checkpointing import commit, export, safe_load, verify
from checkpointing.safe_load import SafeLoadPlanner, UnsafeCheckpointError, load_metadata
from checkpointing.storage import Store
from support.launch import PYTHON, run
from support.tiny_job import (Job, Payload, load_into_fresh, manager, rewrite_marker, same,
                              two_checkpoints, with_planted_step)
from support.logs import our_records

STEP_2 = "step_000000002"
PLANTED = "planted_goodput_mod"  # a module the attacker drops next to the checkpoint


def push_str(s: str) -> bytes:
    data = s.encode()
    return b"X" + struct.pack("<I", len(data)) + data  # BINUNICODE


def push_bytes(b: bytes) -> bytes:
    return b"B" + struct.pack("<I", len(b)) + b  # BINBYTES


def push_global(proto: int, opcode: str, module: str, name: str) -> bytes:
    if opcode == "GLOBAL":  # the text opcode: dotted names resolve under PROTO >= 4
        return b"c" + module.encode() + b"\n" + name.encode() + b"\n"
    return push_str(module) + push_str(name) + b"\x93"  # STACK_GLOBAL


def header(proto: int) -> bytes:
    return b"\x80" + bytes([proto]) if proto >= 2 else b""


def invocations(proto: int, opcode: str, module: str, name: str, arg: bytes) -> List[bytes]:
    """Every opcode that calls what a global names: REDUCE, NEWOBJ, OBJ, INST, and BUILD on
    an instance of it (a planted class's `__setstate__`)."""
    g = push_global(proto, opcode, module, name)
    h = header(proto)
    return [h + g + b"(" + arg + b"tR.",
            h + g + b"(" + arg + b"t\x81.",
            h + b"(" + g + arg + b"o.",
            h + b"(" + arg + b"i" + module.encode() + b"\n" + name.encode() + b"\n.",
            h + g + b")\x81" + arg + b"b."]


def targets(marker: Path) -> List[Tuple[str, str, bytes]]:
    """(module, name, argument): each one, if called, imports or runs what it is given."""
    shell = push_str(f"mkdir {marker}")
    return [
        ("torch.distributed.checkpoint.metadata", "os.system", shell),
        ("torch.distributed.checkpoint.metadata", "Metadata.__init__.__globals__", shell),
        ("torch", "os.system", shell),
        ("torch", "Size.__new__", shell),
        ("torch.serialization", "pickle.loads", push_bytes(pickle.dumps(Payload(marker)))),
        ("torch.distributed.checkpoint._extension", "try_import", push_str(PLANTED)),
        ("builtins", "eval", push_str(f"__import__('os').mkdir({str(marker)!r})")),
        ("builtins", "exec", push_str(f"import os; os.mkdir({str(marker)!r})")),
        ("builtins", "getattr", shell),
        ("builtins", "__import__", push_str(PLANTED)),
        ("importlib", "import_module", push_str(PLANTED)),
        ("torch._utils", "_import_dotted_name", push_str(f"{PLANTED}.Evil")),
        ("copyreg", "_reconstructor", shell),
        ("functools", "partial", shell),
        ("os", "system", shell),
        ("posix", "system", shell),
        ("subprocess", "getoutput", shell),
        (PLANTED, "Evil", shell),
    ]


@pytest.fixture
def planted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A .py file in the current directory that makes `pwned` when imported, as a `python
    -m` run would find it (the current directory is first on its path)."""
    marker = tmp_path / "pwned"
    (tmp_path / f"{PLANTED}.py").write_text(
        f"import os\nos.makedirs({str(marker)!r}, exist_ok=True)\n"
        f"class Evil:\n    def __setstate__(self, state):\n"
        f"        os.makedirs({str(marker)!r}, exist_ok=True)\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield marker
    sys.modules.pop(PLANTED, None)


def assert_nothing_ran(marker: Path) -> None:
    assert not marker.exists()
    assert PLANTED not in sys.modules


def test_the_payloads_are_real(planted):
    """The control: unpickled the way DCP does by default, the payloads run."""
    shell = push_str(f"mkdir {planted}")
    payload = invocations(4, "STACK_GLOBAL", "torch.distributed.checkpoint.metadata",
                          "os.system", shell)[0]
    pickle.loads(payload)
    assert planted.is_dir()
    planted.rmdir()
    pickle.loads(header(2) + push_global(2, "GLOBAL", PLANTED, "Evil") + b")\x81}b.")
    assert planted.is_dir()


@pytest.mark.parametrize("proto,opcode", [(0, "GLOBAL"), (2, "GLOBAL"), (4, "GLOBAL"),
                                          (4, "STACK_GLOBAL"), (5, "STACK_GLOBAL")])
def test_metadata_naming_anything_but_dcp_types_is_refused(planted, proto, opcode):
    for module, name, arg in targets(planted):
        for payload in invocations(proto, opcode, module, name, arg):
            with pytest.raises(UnsafeCheckpointError, match="refusing"):
                load_metadata(io.BytesIO(payload))
            assert_nothing_ran(planted)


@pytest.mark.parametrize("ext", [b"\x82", b"\x83", b"\x84"])
def test_extension_registry_codes_are_refused(planted, ext):
    """EXT1/2/4 name a global by a number some library registered: the same check applies."""
    code = {b"\x82": 0xF1, b"\x83": 0xF123, b"\x84": 0xF12345}[ext]
    width = {b"\x82": "<B", b"\x83": "<H", b"\x84": "<i"}[ext]
    module, name = "torch.distributed.checkpoint.metadata", "os.system"
    copyreg.add_extension(module, name, code)
    try:
        payload = header(4) + ext + struct.pack(width, code) + b"(" + push_str(
            f"mkdir {planted}") + b"tR."
        with pytest.raises(UnsafeCheckpointError, match=f"refusing to load {module}.{name}"):
            load_metadata(io.BytesIO(payload))
    finally:
        copyreg.remove_extension(module, name, code)
    assert_nothing_ran(planted)


@pytest.mark.parametrize("payload", [b"P1\n.", header(2) + push_str("x") + b"Q."],
                         ids=["PERSID", "BINPERSID"])
def test_persistent_ids_are_refused(payload):
    with pytest.raises(UnsafeCheckpointError, match="persistent id"):
        load_metadata(io.BytesIO(payload))


def real_metadata(tmp_path: Path) -> bytes:
    root, _ = two_checkpoints(tmp_path)
    return (root / STEP_2 / ".metadata").read_bytes()


def test_real_metadata_loads_and_forged_shapes_are_refused(tmp_path):
    metadata = load_metadata(io.BytesIO(real_metadata(tmp_path)))
    assert {"model.0.weight", "optim.state.0.weight.exp_avg", "position.trainer.step"} <= set(
        metadata.state_dict_metadata)
    forged = [header(2) + b"]" * 200_000 + b"a" * 199_999 + b".",  # deeply nested
              header(2) + b"}" + push_str("x") + b"]s.",  # a dict, not Metadata
              header(2) + push_global(2, "GLOBAL", "torch.serialization", "_get_layout")
              + b"(" + push_str("torch.sparse_coo').__class__") + b"tR."]
    for data in forged:
        with pytest.raises(UnsafeCheckpointError):
            load_metadata(io.BytesIO(data))


def text_global(module: str, name: str) -> bytes:
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


# Live objects a file can reach through allowed names, each as the opcodes that put it on the
# stack: the allowed classes and function themselves, and the shared values they hand out.
_REACHABLE = {
    **{f"{module}.{name}": text_global(module, name) for module, name in safe_load._ALLOWED},
    "torch.strided": text_global("torch.serialization", "_get_layout")
    + b"(S'torch.strided'\ntR",
    "_MEM_FORMAT_ENCODING(0)": text_global("torch.distributed.checkpoint.metadata",
                                           "_MEM_FORMAT_ENCODING") + b"(I0\ntR",
    "torch.Size(())": text_global("torch", "Size") + b"((ttR",
    "PosixPath('/x')": text_global("pathlib", "PosixPath") + b"(S'/x'\ntR",
}


def build_states(proto: int, attr: str) -> List[bytes]:
    """BUILD's two forms, a dict (instance `__dict__`) and (None, slotstate) (setattr), in
    the protocol's own opcodes."""
    if proto == 0:
        pair = b"S'" + attr.encode() + b"'\nN"
        return [b"(d" + pair + b"s", b"(N(d" + pair + b"st"]
    pair = push_str(attr) + b"N"
    return [b"}" + pair + b"s", b"N}" + pair + b"s\x86"]


def live_state() -> dict:
    """What BUILD could change: every allowed object's and shared value's own attributes."""
    objects = [*safe_load._ALLOWED.values(), *safe_load._LAYOUTS.values(),
               *list(safe_load._ALLOWED[("torch.distributed.checkpoint.metadata",
                                         "_MEM_FORMAT_ENCODING")])]
    return {id(o): dict(vars(o)) for o in objects if hasattr(o, "__dict__")}


@pytest.mark.parametrize("proto", [0, 2, 4, 5])
def test_build_never_changes_an_allowed_class_or_shared_value(proto):
    """BUILD sets attributes on whatever is on the stack: on an allowed class it would
    rewrite the trainer's own classes for the whole process (`PosixPath.__fspath__ = None`)."""
    before = live_state()
    for target, push in _REACHABLE.items():
        for attr in ["__fspath__", "__init__", "__setstate__", "planted"]:
            for state in build_states(proto, attr):
                payload = header(proto) + push + state + b"b."
                with pytest.raises(UnsafeCheckpointError, match="refusing"):
                    load_metadata(io.BytesIO(payload))
                assert live_state() == before, (target, attr, state)
    assert pathlib.PosixPath("/x").__fspath__() == "/x"


def test_storage_meta_is_never_an_allowed_class_or_shared_value(tmp_path):
    """DCP's reader sets `load_id` on `.metadata`'s `storage_meta`: an allowed class or a
    shared enum member there got it set on the trainer's own, for the whole process."""
    enum = safe_load._ALLOWED[("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING")]
    files = {target: pickle.dumps(Metadata(state_dict_metadata={}, storage_meta=target),
                                  protocol=4)
             for target in [Metadata, StorageMeta, pathlib.PosixPath, torch.Size, *list(enum)]}
    before = live_state()  # after pickling, which caches __slotnames__ on a class
    for target, data in files.items():
        (tmp_path / ".metadata").write_bytes(data)
        with pytest.raises(UnsafeCheckpointError, match="storage_meta"):
            safe_load.SafeFileSystemReader(str(tmp_path)).read_metadata()
        assert live_state() == before, target


def record(proto: int, cls: type, state: bytes) -> bytes:
    g = push_global(proto, "STACK_GLOBAL" if proto >= 4 else "GLOBAL", cls.__module__,
                    cls.__name__)
    return header(proto) + g + b")\x81" + state + b"b."


@pytest.mark.parametrize("proto", [2, 4, 5])
def test_a_record_takes_only_its_own_fields(proto):
    """A state naming anything but the record's fields (`__setstate__` put on the instance
    would be called by the next BUILD) or given as slots is refused."""
    for state in [b"}" + push_str("__setstate__") + push_str("x") + b"s",
                  b"}" + push_str("planted") + b"Ns", b"N}" + push_str("offset") + b"Ks\x86",
                  b"N"]:
        with pytest.raises(UnsafeCheckpointError, match="refusing"):
            load_metadata(io.BytesIO(record(proto, _StorageInfo, state)))


def dcp_like_metadata(ranks: int = 3) -> Metadata:
    """Every record and value DCP's `.metadata` holds, a tensor sharded over `ranks`."""
    chunk = ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([2, 3]))
    return Metadata(
        state_dict_metadata={
            "w": TensorStorageMetadata(TensorProperties(dtype=torch.bfloat16,
                                                        memory_format=torch.channels_last),
                                       torch.Size([2, 3]), [chunk]),
            "sharded": TensorStorageMetadata(
                TensorProperties(dtype=torch.float32, requires_grad=True),
                torch.Size([4 * ranks]),
                [ChunkStorageMetadata(torch.Size([4 * r]), torch.Size([4]))
                 for r in range(ranks)]),
            "step": BytesStorageMetadata()},
        storage_data={MetadataIndex("w", torch.Size([0, 0]), 0): _StorageInfo("__0_0.distcp",
                                                                                0, 24),
                      MetadataIndex("step"): _StorageInfo("__0_0.distcp", 24, 8),
                      **{MetadataIndex("sharded", torch.Size([4 * r]), 0): _StorageInfo(
                          f"__{r}_0.distcp", 32, 16, ("raw_tensor_little_endian",))
                         for r in range(ranks)}},
        storage_meta=StorageMeta(checkpoint_id=pathlib.PosixPath("/ck/step_1")),
        planner_data={"w": ("w",)})


@pytest.mark.parametrize("proto", [2, 4, 5])
def test_metadata_as_dcp_writes_it_loads(proto):
    """Every record and value DCP's `.metadata` holds still loads: its own BUILDs pass."""
    metadata = dcp_like_metadata()
    loaded = load_metadata(io.BytesIO(pickle.dumps(metadata, protocol=proto)))
    assert loaded == metadata


def reference_load(data: bytes) -> Metadata:
    """The standard library's pure-Python unpickler under the same rules: what a file
    means, by definition."""
    metadata = safe_load.MetadataUnpickler(io.BytesIO(data)).load()
    safe_load._check_structure(metadata)
    return metadata


@pytest.mark.parametrize("proto", [2, 3, 4, 5])
def test_the_fast_path_reads_what_the_reference_unpickler_reads(tmp_path, proto):
    """Byte for byte the same objects (re-pickled: same types, same sharing); files of the
    protocols DCP writes (4, and 5 from Python 3.14 on) take the fast path."""
    real = reference_load(real_metadata(tmp_path))
    for metadata in (real, dcp_like_metadata()):
        data = pickle.dumps(metadata, protocol=proto)
        if proto >= 4:
            fast = safe_load._parse_common(data)  # no fall-back: _Uncommon would raise
            assert pickle.dumps(fast) == pickle.dumps(reference_load(data))
        assert pickle.dumps(load_metadata(io.BytesIO(data))) == pickle.dumps(metadata)


def outcome(load: Callable[[], Metadata]) -> Tuple[str, object]:
    try:
        return "read", pickle.dumps(load())
    except Exception as err:
        return "refused", type(err).__name__ if not isinstance(
            err, UnsafeCheckpointError) else str(err)


def test_a_damaged_metadata_means_what_it_means_to_the_reference_unpickler():
    """Flipped, dropped, inserted bytes and truncations anywhere (opcodes, lengths, memo
    indexes, frame sizes): `load_metadata` reads what the reference reads and refuses what
    it refuses, with the same refusal."""
    data = pickle.dumps(dcp_like_metadata(), protocol=4)
    rng = random.Random(7)
    read = 0
    for trial in range(1500):
        damaged = bytearray(data)
        at = rng.randrange(len(data))
        if trial % 4 == 0:
            damaged[at] = rng.randrange(256)
        elif trial % 4 == 1:
            damaged[at] ^= 1 << rng.randrange(8)
        elif trial % 4 == 2:
            del damaged[at:at + rng.randrange(1, 4)]
        else:
            damaged[at:at] = bytes([rng.randrange(256)])
        damaged = bytes(damaged)
        expected = outcome(lambda: reference_load(damaged))
        assert outcome(lambda: load_metadata(io.BytesIO(damaged))) == expected, (trial, at)
        read += expected[0] == "read"
    assert 30 < read < 1400  # both kinds of outcome were compared


@pytest.mark.parametrize("memo", [b"r\xff\xff\xff\xff", b"r\x00\x00\x00\x40",
                                  b"p4294967295\n", b"p99999999999999999999\n"])
def test_a_memo_index_costs_what_it_holds_not_what_its_number_says(memo):
    """Pickle's C unpickler grows its memo to the largest index a file names (16-64 GB for
    these 10-byte files); the restricted ones keep a dict."""
    tracemalloc.start()
    try:
        with pytest.raises(UnsafeCheckpointError, match="not DCP Metadata"):
            load_metadata(io.BytesIO(b"\x80\x04N" + memo + b"."))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20


def binget(index: int) -> bytes:
    return b"h" + bytes([index]) if index < 256 else b"j" + struct.pack("<I", index)


def nested_pairs(depth: int) -> bytes:
    """Protocol 4 opcodes leaving T0 .. T`depth` on the stack (and memo), T0 = (None,) and
    each T = (previous, previous): a few bytes a level, 2^depth steps to hash the last."""
    return b"N\x85\x94" + b"".join(binget(d - 1) * 2 + b"\x86\x94" for d in range(1, depth + 1))


def test_nothing_a_file_puts_on_the_stack_is_hashed_without_bound(tmp_path):
    """A tuple's hash walks everything it holds: sixty nested pairs (a 370-byte file) take
    2^60 steps, a few hundred thousand nested tuples overflow the C stack. Whatever a file
    names as a callable, a class, a key or an enum value is refused before it is hashed, by
    the fast path and the reference alike (checked in a child: hashing never returns)."""
    enum = push_str("torch.distributed.checkpoint.metadata") + push_str(
        "_MEM_FORMAT_ENCODING") + b"\x93"
    payloads = {
        "REDUCE of a tuple": nested_pairs(60) + b")R.",
        "NEWOBJ of a tuple": nested_pairs(60) + b")\x81.",
        "SETITEM": b"}" + nested_pairs(60) + b"Ns.",
        "SETITEMS": b"}(" + nested_pairs(60) + b"u.",
        "an enum's value": nested_pairs(60) + enum + binget(60) + b"\x85R.",
        "deeply nested key": b"}N" + b"\x85" * 300_000 + b"Ns.",
    }
    for name, payload in payloads.items():
        (tmp_path / name).write_bytes(header(4) + payload)
    child = (
        "import io, pathlib, sys\n"
        "from checkpointing import safe_load\n"
        "for path in sorted(pathlib.Path(sys.argv[1]).iterdir()):\n"
        "    data = path.read_bytes()\n"
        "    seen = []\n"
        "    for load in (lambda: safe_load.load_metadata(io.BytesIO(data)),\n"
        "                 lambda: safe_load.MetadataUnpickler(io.BytesIO(data)).load()):\n"
        "        try:\n"
        "            load()\n"
        "            seen.append('read')\n"
        "        except safe_load.UnsafeCheckpointError as err:\n"
        "            seen.append(str(err))\n"
        "    print(path.name, *seen, sep='\\t')\n")
    result = run(PYTHON, ["-c", child, str(tmp_path)], timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    lines = result.stdout.splitlines()
    assert len(lines) == len(payloads), result.stdout
    for line in lines:
        name, fast, reference = line.split("\t")
        assert fast == reference and fast.startswith("refusing"), line


def test_a_call_never_copies_a_shared_list_over_and_over():
    """torch.Size copies its dims and PosixPath parses its parts: given one memoized list
    or string again and again (BINGET: two bytes), a 1 MB file took gigabytes. A call takes
    the few small arguments DCP's pickling gives it, or the file is refused."""
    size = push_str("torch") + push_str("Size") + b"\x93\x94"  # memo 0
    path = push_str("pathlib") + push_str("PosixPath") + b"\x93\x94"
    shared = {  # memo 1: what each call is given; the call, a hundred times over
        "dims": (size + b"](" + b"\x89" * 100_000 + b"e\x94", binget(1) + b"\x85R"),
        "path": (path + push_str("a/" * 50_000) + b"\x94", binget(1) + b"\x85R"),
        "parts": (path + b"(" + push_str("a") * 100_000 + b"t\x94", binget(1) + b"R")}
    for name, (made, call) in shared.items():
        payload = header(4) + made + (binget(0) + call) * 100 + b"."
        tracemalloc.start()
        try:
            with pytest.raises(UnsafeCheckpointError):
                load_metadata(io.BytesIO(payload))
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 16 << 20, (name, peak)
    assert load_metadata(io.BytesIO(pickle.dumps(dcp_like_metadata(), protocol=4))) == \
        dcp_like_metadata()  # DCP's own calls pass


def test_tensors_that_share_a_chunk_list_are_refused():
    """DCP gives each tensor its own record and chunk list. One list under many names
    (two bytes each) was checked once per name: 240 KB took 36 s, a 2 MB file hours."""
    chunk = ChunkStorageMetadata(torch.Size([0]), torch.Size([1]))
    chunks = [chunk] * 10_000
    shared = TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size([1]), chunks)
    for entries in ({f"w{i}": shared for i in range(1000)},
                    {f"w{i}": TensorStorageMetadata(TensorProperties(), torch.Size([1]), chunks)
                     for i in range(1000)}):
        data = pickle.dumps(Metadata(state_dict_metadata=entries), protocol=4)
        with pytest.raises(UnsafeCheckpointError, match="share"):
            load_metadata(io.BytesIO(data))


def test_a_file_the_fast_path_hands_over_is_not_held_twice():
    """One byte (a None under the Metadata) makes the fast path parse all of a file and
    then hand it to the reference: what it built must be gone by then, not held by its
    exception's traceback (twice the memory of a large `.metadata`)."""
    data = pickle.dumps(dcp_like_metadata(ranks=3000), protocol=4)
    assert data[2] == pickle.FRAME[0]  # one None more in the first frame
    size = struct.unpack_from("<Q", data, 3)[0]
    hostile = data[:3] + struct.pack("<Q", size + 1) + b"N" + data[11:]
    peaks = []
    for load in (lambda: reference_load(hostile), lambda: load_metadata(io.BytesIO(hostile))):
        tracemalloc.start()
        try:
            assert pickle.dumps(load()) == pickle.dumps(dcp_like_metadata(ranks=3000))
            peaks.append(tracemalloc.get_traced_memory()[1])
        finally:
            tracemalloc.stop()
    assert peaks[1] < 1.3 * peaks[0], peaks


@pytest.mark.parametrize("enabled", [True, False])
def test_the_garbage_collector_is_left_as_it_was(tmp_path, enabled):
    """A load pauses it (its passes took half the time of a large `.metadata`), read or
    refused, and puts it back as it found it."""
    was = gc.isenabled()
    (gc.enable if enabled else gc.disable)()
    try:
        load_metadata(io.BytesIO(pickle.dumps(dcp_like_metadata(), protocol=4)))
        assert gc.isenabled() is enabled
        with pytest.raises(UnsafeCheckpointError):
            load_metadata(io.BytesIO(b"\x80\x04N."))
        assert gc.isenabled() is enabled
    finally:
        (gc.enable if was else gc.disable)()


def test_metadata_over_the_size_limit_is_refused_unread(monkeypatch):
    monkeypatch.setattr(safe_load, "MAX_METADATA_BYTES", 1000)
    with pytest.raises(UnsafeCheckpointError, match="over"):
        load_metadata(io.BytesIO(b"\x80\x04" + b"N" * 5000 + b"."))


def plant_metadata(step_dir: Path, data: bytes) -> None:
    (step_dir / ".metadata").write_bytes(data)
    rewrite_marker(step_dir)  # re-signed: the checksums alone pass


def test_a_resigned_hostile_metadata_is_a_damaged_checkpoint_everywhere(planted, tmp_path,
                                                                       caplog, capsys):
    """Resume falls back with one line, verify reports it, export refuses: all through the
    same restricted load, and none runs it."""
    root, first = two_checkpoints(tmp_path)
    payload = invocations(4, "STACK_GLOBAL", "torch.distributed.checkpoint.metadata",
                          "os.system", push_str(f"mkdir {planted}"))[0]
    plant_metadata(root / STEP_2, payload)

    warning = resume_falls_back_to(first, root, caplog)
    assert STEP_2 in warning and "refusing" in warning

    assert verify.main([str(root)]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(f"{STEP_2}  INCOMPLETE: .metadata is unsafe: refusing")
    assert lines[1].startswith("step_000000001  complete")

    assert export.main([str(root / STEP_2), str(tmp_path / "model.pt")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "refusing" in err[0], err
    assert not (tmp_path / "model.pt").exists()
    assert_nothing_ran(planted)


def test_a_metadata_declaring_huge_tensors_is_not_allocated_by_export(tmp_path, capsys):
    """Export allocates tensors of the sizes `.metadata` declares: a forged size would take
    all memory before a byte is read."""
    root, _ = two_checkpoints(tmp_path)
    metadata = load_metadata(io.BytesIO((root / STEP_2 / ".metadata").read_bytes()))
    metadata.state_dict_metadata["model.0.weight"].size = torch.Size([1 << 20, 1 << 20])
    plant_metadata(root / STEP_2, pickle.dumps(metadata))
    assert export.main([str(root / STEP_2), str(tmp_path / "model.pt")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "declares" in err[0], err


def test_links_in_a_checkpoint_are_not_followed(tmp_path):
    """A file linked to /dev/zero reads forever (its size is 0, as signed); one linked
    outside reads another file. Both make the checkpoint incomplete, at once."""
    root, _ = two_checkpoints(tmp_path)
    marker = root / STEP_2 / "commit_rank_0.json"
    elsewhere = tmp_path / "marker.json"
    marker.rename(elsewhere)
    marker.symlink_to(elsewhere)  # the same bytes, through a link
    step_1 = root / "step_000000001" / "commit_rank_0.json"
    step_1.unlink()
    step_1.symlink_to("/dev/zero")
    result = run(PYTHON, ["-m", "checkpointing.verify", str(root)], timeout=60)
    assert result.returncode == 1, result.stderr
    assert result.stdout.splitlines() == [
        f"{STEP_2}  INCOMPLETE: commit_rank_0.json is not a regular file (a symlink, device "
        f"or directory)",
        "step_000000001  INCOMPLETE: commit_rank_0.json is not a regular file (a symlink, "
        "device or directory)"]


@pytest.mark.parametrize("body", [b"not json", b"[" * 100_000, b"[]", b'{"files": 3}',
                                  b"\xff\xfe", json.dumps({"step": 2, "world_size": 1,
                                                           "files": {"x": {"size": "1" * 5000,
                                                                           "sha256": ""}}}
                                                          ).encode()],
                         ids=["text", "nested", "list", "files-int", "binary", "huge-int"])
def test_a_marker_that_is_not_a_marker_makes_the_checkpoint_incomplete(tmp_path, caplog, body):
    root, first = two_checkpoints(tmp_path)
    (root / STEP_2 / "commit_rank_0.json").write_bytes(body)
    with caplog.at_level(logging.WARNING):
        job = Job(seed=9)
        assert manager(root).load_latest(job.state()).step == 1
    assert same(job.snapshot(), first)
    assert "commit_rank_0.json is unreadable" in caplog.text


def test_a_marker_over_the_size_limit_is_refused_unread(tmp_path, monkeypatch):
    root, _ = two_checkpoints(tmp_path)
    monkeypatch.setattr(commit, "MAX_MARKER_BYTES", 100)
    with pytest.raises(commit.Incomplete, match="not a commit marker"):
        commit.verify(Store(str(root)), STEP_2, 2)


def test_an_unsigned_metadata_is_not_trusted(tmp_path):
    root, _ = two_checkpoints(tmp_path)
    marker = root / STEP_2 / "commit_rank_0.json"
    body = json.loads(marker.read_text())
    del body["files"][".metadata"]
    marker.write_text(json.dumps(body))
    with pytest.raises(commit.Incomplete, match="no commit marker lists .metadata"):
        commit.verify(Store(str(root)), STEP_2, 2)


def torch_saved_with(data_pkl: bytes) -> io.BytesIO:
    """A `torch.save` archive (what DCP stores for a non-tensor item) holding `data_pkl`."""
    buffer = io.BytesIO()
    torch.save({"step": 1}, buffer)
    buffer.seek(0)
    out = io.BytesIO()
    with zipfile.ZipFile(buffer) as src, zipfile.ZipFile(out, "w") as dst:
        for info in src.infolist():
            dst.writestr(info, data_pkl if info.filename.endswith("/data.pkl")
                         else src.read(info))
    out.seek(0)
    return out


def test_non_tensor_items_naming_anything_are_refused(planted):
    planner = SafeLoadPlanner()
    index = MetadataIndex("trainer.step")
    item = ReadItem(LoadItemType.BYTE_IO, index, torch.Size([0]), index, torch.Size([0]),
                    torch.Size([0]))
    for proto, opcode in [(2, "GLOBAL"), (4, "STACK_GLOBAL")]:
        for module, name, arg in targets(planted):
            for payload in invocations(proto, opcode, module, name, arg):
                with pytest.raises(UnsafeCheckpointError, match="refusing to load item"):
                    planner.load_bytes(item, torch_saved_with(payload))
                assert_nothing_ran(planted)


def test_a_hostile_non_tensor_item_falls_back_to_the_previous_checkpoint(tmp_path, caplog):
    marker = tmp_path / "pwned"
    root = tmp_path / "ckpt"
    mgr = manager(root, async_mode="off")
    job = Job()
    mgr.save(1, job.state())
    first = job.snapshot()
    mgr.save(2, with_planted_step(job, marker))
    assert resume_falls_back_to(first, root, caplog).startswith(
        f"checkpoint {root / STEP_2} failed to load (UnsafeCheckpointError: refusing to load "
        f"item position.trainer.step: ")
    assert not marker.exists()


def _forge_raw(field: str):
    """A change to `.metadata`'s record of model.0.weight (or of its chunk)."""
    def forge(metadata: Metadata) -> None:
        entry = metadata.state_dict_metadata["model.0.weight"]
        index, info = next((i, s) for i, s in metadata.storage_data.items()
                           if i.fqn == "model.0.weight")
        if field == "huge length":
            info.length = 1 << 42
        elif field == "past the end":
            info.offset += 1 << 30
        elif field == "negative offset":
            info.offset = -8
        elif field == "shape":
            entry.chunks[0].sizes = torch.Size([s * 2 for s in entry.chunks[0].sizes])
        elif field == "dtype":
            entry.properties.dtype = torch.float64
        elif field == "no such chunk":
            metadata.storage_data[MetadataIndex(index.fqn, [7] * len(index.offset), 0)] = (
                metadata.storage_data.pop(index))
        elif field == "another file":
            info.relative_path = "../../../etc/passwd"
        elif field in ODD_DESCRIPTORS:
            info.transform_descriptors = ODD_DESCRIPTORS[field]
        elif field in ODD_DTYPES:
            entry.properties.dtype = ODD_DTYPES[field]
        elif field in ODD_SIZES:
            entry.chunks[0].sizes = ODD_SIZES[field]
    return forge


ODD_DESCRIPTORS = {"descriptor twice": ("raw_tensor", "raw_tensor"),
                   "descriptor str": "raw_tensor", "descriptor int": 5,
                   "descriptor bytes": b"raw_tensor", "descriptor none": None,
                   "descriptors by the million": ["raw_tensor"] * 1_000_000}
ODD_DTYPES = {f"dtype {d}": getattr(torch, d)
              for d in ("bool", "uint1", "uint7", "float8_e4m3fn", "qint32", "bits16")}
ODD_SIZES = {"sizes huge": torch.Size([1 << 62, 1 << 62]), "sizes float": [16.0, 8.0],
             "sizes str": ["16", "8"], "sizes none": None, "sizes int": 128,
             "sizes one dim more": torch.Size([16, 8, 1])}


FORGERIES = ["huge length", "past the end", "negative offset", "shape", "dtype",
             "no such chunk", "another file", *ODD_DESCRIPTORS, *ODD_DTYPES, *ODD_SIZES]


# No descriptor is what a standard record has: nothing forged there.
@pytest.mark.parametrize("format,field", [(f, field) for f in ("dcp", "raw")
                                          for field in FORGERIES
                                          if (f, field) != ("dcp", "descriptor none")])
def test_a_forged_tensor_record_is_a_damaged_checkpoint(tmp_path, caplog, field, format):
    """`.metadata` places each tensor's record (a torch.save archive, or raw bytes): a
    re-signed record that lies about where it is or what dtype and shape it holds is
    refused before anything is allocated or read outside the checkpoint, and resume falls
    back to the previous checkpoint."""
    root, first = forged_step_2(tmp_path, _forge_raw(field), format=format)
    assert STEP_2 in resume_falls_back_to(first, root, caplog)


def forged_step_2(tmp_path: Path, forge, **kw) -> tuple:
    """Two checkpoints (`kw`: their CheckpointOptions), the second's `.metadata` changed by
    `forge` and re-signed; the root and the first checkpoint's state."""
    root, first = two_checkpoints(tmp_path, **kw)
    metadata = load_metadata(io.BytesIO((root / STEP_2 / ".metadata").read_bytes()))
    forge(metadata)
    plant_metadata(root / STEP_2, pickle.dumps(metadata))
    return root, first


def resume_falls_back_to(first: dict, root: Path, caplog) -> str:
    """Resume loads step 1, holding `first`, after one warning line (returned). Through
    `load_latest`, the one loop of the trainer's resume and rollback."""
    with caplog.at_level(logging.WARNING):
        job = Job(seed=9)
        assert manager(root).load_latest(job.state()).step == 1
    assert same(job.snapshot(), first)
    warnings = [r.getMessage() for r in our_records(caplog) if r.levelno >= logging.WARNING]
    assert len(warnings) == 1, warnings
    assert "\n" not in warnings[0] and not any(r.exc_info for r in our_records(caplog))
    return warnings[0]


def _split_rows(metadata: Metadata, second_row: int) -> None:
    """model.0.weight (16 x 8, one chunk) recorded as two chunks of 8 rows, the second
    starting at `second_row`: 8 is how two ranks would have saved it, 4 overlaps the first
    and leaves rows 12 to 15 to no chunk."""
    entry = metadata.state_dict_metadata["model.0.weight"]
    index, info = next((i, s) for i, s in metadata.storage_data.items()
                       if i.fqn == "model.0.weight")
    half = info.length // 2
    entry.chunks = [ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([8, 8])),
                    ChunkStorageMetadata(torch.Size([second_row, 0]), torch.Size([8, 8]))]
    del metadata.storage_data[index]
    for n, chunk in enumerate(entry.chunks):
        metadata.storage_data[MetadataIndex(index.fqn, chunk.offsets, n)] = _StorageInfo(
            info.relative_path, info.offset + n * half, half, info.transform_descriptors)


CHUNKS_THAT_MISS = {
    "negative sizes": lambda m: setattr(m.state_dict_metadata["model.0.weight"].chunks[0],
                                        "sizes", torch.Size([-16, -8])),
    "no rows": lambda m: setattr(m.state_dict_metadata["model.0.weight"].chunks[0],
                                 "sizes", torch.Size([0, 1 << 62])),
    "transposed": lambda m: setattr(m.state_dict_metadata["model.0.weight"].chunks[0],
                                    "sizes", torch.Size([8, 16])),
    "overlap and gap": lambda m: _split_rows(m, second_row=4),
}


@pytest.mark.parametrize("forgery", sorted(CHUNKS_THAT_MISS))
def test_chunks_that_leave_part_of_a_tensor_unread_are_a_damaged_checkpoint(
        tmp_path, caplog, capsys, forgery):
    """DCP reads only where `.metadata`'s chunks meet the live tensor: chunks with a gap
    would leave the live weights on resume, uninitialized memory in export, silently."""
    root, first = forged_step_2(tmp_path, CHUNKS_THAT_MISS[forgery])
    assert "model.0.weight: the chunks" in resume_falls_back_to(first, root, caplog)
    assert export.main([str(root / STEP_2), str(tmp_path / "model.pt")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and STEP_2 in err[0], err
    assert not (tmp_path / "model.pt").exists()


def test_a_tensor_in_several_chunks_loads_whole(tmp_path):
    """The check above passes chunks that make up the tensor, as resharding reads them
    (raw records: a chunk's bytes are a slice of the tensor's)."""
    root, _ = two_checkpoints(tmp_path, format="raw")
    whole = Job(seed=9)
    assert manager(root).load_latest(whole.state()).step == 2
    metadata = load_metadata(io.BytesIO((root / STEP_2 / ".metadata").read_bytes()))
    _split_rows(metadata, second_row=8)
    plant_metadata(root / STEP_2, pickle.dumps(metadata))
    job = Job(seed=9)
    assert manager(root).load_latest(job.state()).step == 2
    assert same(job.snapshot(), whole.snapshot())


@pytest.mark.parametrize("format", ["dcp", "raw"])
def test_a_file_that_shrinks_while_it_is_read_is_a_damaged_checkpoint(tmp_path, caplog,
                                                                      monkeypatch, format):
    """Its size is taken once, before the reads: one cut short after that is one line."""
    root, first = two_checkpoints(tmp_path, format=format)
    read_raw = safe_load._DirectTensors._load_tensor

    def shrinking(reader, stream, size, item, planner):
        os.truncate(root / STEP_2 / "__0_0.distcp", 10)
        return read_raw(reader, stream, size, item, planner)

    monkeypatch.setattr(safe_load._DirectTensors, "_load_tensor", shrinking)
    assert "bytes short" in resume_falls_back_to(first, root, caplog)
    assert not any(r.exc_info for r in our_records(caplog))


def test_a_resume_lets_go_of_the_metadata_it_parsed(tmp_path):
    """Verification and the load share one parse of `.metadata`; past the load nothing
    keeps it (at 1 B parameters on 1,024 ranks it is over a GB of records per rank)."""
    root, _ = two_checkpoints(tmp_path)
    step, _ = load_into_fresh(manager(root))
    assert step == 2
    assert safe_load._last_parsed is None

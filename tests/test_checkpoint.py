"""CheckpointManager in one process: snapshots, the commit protocol, corruption, hostile
pickles, retention. (Killed-process tests are in test_resume.py.)"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import math
import os
import shutil
import threading
import time
import zipfile

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from checkpointing import commit, verify
from checkpointing.archive import no_crc32, tensor_archive
from checkpointing.manager import CheckpointError, CheckpointManager, CheckpointOptions
from checkpointing.safe_load import load_metadata
from checkpointing.staging import WarmStager
from checkpointing.storage import Store
from checkpointing.writer import Writer
from support.checkpoints import flip_byte
from support.tiny_job import (Job, Payload, load_into_fresh, manager, rewrite_marker, same,
                              two_checkpoints, with_planted_step)
from support.logs import our_records
from support.runs import compose_config
from support.worlds import one_rank_world  # noqa: F401  (a fixture)
from train.records import events
from train.resume.checkpoint import RunCheckpoints
from train.resume.stateful import DataIdentity, Position, RunInfo


@pytest.mark.parametrize("mode", ["off", "thread"])
@pytest.mark.parametrize("staging", [False, True])
def test_round_trip_and_commit_layout(tmp_path, mode, staging):
    job = Job()
    mgr = manager(tmp_path / "ckpt", async_mode=mode,
                  staging_dir=str(tmp_path / "stage") if staging else None)
    mgr.save(job.position.step, job.state())
    expected = job.snapshot()
    mgr.close()
    names = os.listdir(tmp_path / "ckpt")
    assert names == ["step_000000001"]  # no partial left, committed by rename
    assert set(os.listdir(tmp_path / "ckpt" / names[0])) == {
        ".metadata", "__0_0.distcp", "commit_rank_0.json"}
    step, loaded = load_into_fresh(manager(tmp_path / "ckpt"))
    assert step == 1 and same(loaded, expected)


class SlowWriter:
    """Makes DCP's file writing slow, so the loop runs on while a save is in flight."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, seconds: float) -> None:
        original = Writer.write_data

        def slow(writer, plan, planner):
            time.sleep(seconds)
            return original(writer, plan, planner)

        monkeypatch.setattr(Writer, "write_data", slow)


def mutate_everything(job: Job) -> None:
    with torch.no_grad():
        for p in job.model.parameters():
            p.add_(1.0)
        job.model[1].running_mean.add_(5.0)
    for s in job.optimizer.state.values():
        s["exp_avg"].add_(3.0)
    job.position = job.position.advanced(steps_per_epoch=3)


@pytest.mark.parametrize("mode", ["thread", "process"])
def test_async_saves_are_snapshots_taken_before_save_returns(tmp_path, monkeypatch, mode,
                                                             one_rank_world):
    """Everything is changed the moment `save` returns, while the write is in flight (slowed
    in this process; DCP's process first receives and plans the save); each of several
    saves, the later ones copying into the buffers of the first, holds the values at its
    own save: neither torn nor stale."""
    SlowWriter(monkeypatch, 0.5)
    job = Job()
    world = one_rank_world
    mgr = CheckpointManager(CheckpointOptions(dir=str(tmp_path / "ckpt"), async_mode=mode,
                                              keep_last=3),
                            world.rank, world.world_size, world.control_group)
    expected = {}
    for step in (1, 2, 3):
        mgr.save(step, job.state())
        expected[step] = job.snapshot()
        mutate_everything(job)
        if mode == "thread":
            assert mgr._pending is not None and mgr._pending.is_alive()
    mgr.close()
    assert not same(expected[1]["model"], expected[2]["model"])  # each save is told apart
    for step in (1, 2, 3):
        fresh = Job(seed=123)
        assert manager(tmp_path / "ckpt").load(step, fresh.state())
        assert same(fresh.snapshot(), expected[step]), step


def test_the_snapshot_test_catches_a_torn_snapshot(tmp_path, monkeypatch):
    """Negative control: with staging that skips the copy, the mutations do leak."""
    SlowWriter(monkeypatch, 0.5)
    monkeypatch.setattr(WarmStager, "stage", lambda self, state_dict: state_dict)
    job = Job()
    mgr = manager(tmp_path / "ckpt", async_mode="thread")
    mgr.save(1, job.state())
    expected = job.snapshot()
    mutate_everything(job)
    mgr.close()
    _, loaded = load_into_fresh(manager(tmp_path / "ckpt"))
    assert not same(loaded["model"], expected["model"])


def test_staging_reuses_its_buffers_and_copies_the_live_values():
    """The second save copies into the memory of the first (no allocation, no page faults):
    the same addresses, holding the new values."""
    job = Job()
    stager = WarmStager(share_memory=False)
    first = {k: v for k, v in stager.stage(job.model.state_dict()).items()}
    addresses = {k: v.data_ptr() for k, v in first.items()}
    mutate_everything(job)
    second = stager.stage(job.model.state_dict())
    assert {k: v.data_ptr() for k, v in second.items()} == addresses
    live = job.model.state_dict()
    assert all(torch.equal(second[k], live[k]) and second[k].data_ptr() != live[k].data_ptr()
               for k in live)


def test_async_and_sync_saves_hold_identical_content(tmp_path):
    job = Job()
    for mode in ("off", "thread"):
        mgr = manager(tmp_path / mode, async_mode=mode)
        mgr.save(1, job.state())
        mgr.close()
    _, a = load_into_fresh(manager(tmp_path / "off"))
    _, b = load_into_fresh(manager(tmp_path / "thread"))
    assert same(a, b) and same(a, job.snapshot())



def test_raw_records_refuse_stock_dcp_and_every_format_loads(tmp_path, monkeypatch):
    """`checkpoint.format=raw` stores tensors as their bytes (no per-tensor `torch.save`),
    which DCP's stock reader refuses loudly instead of misreading. The default format holds
    one archive per tensor, as DCP's own writer (this trainer's earlier versions) does; all
    three load, bit for bit."""
    job = Job()
    for format in ("raw", "dcp"):
        mgr = manager(tmp_path / format, async_mode="off", format=format)
        mgr.save(1, job.state())
        mgr.close()
    step_dir = tmp_path / "raw" / "step_000000001"
    assert job.model.state_dict()["0.weight"].numpy().tobytes() in (
        step_dir / "__0_0.distcp").read_bytes()
    with pytest.raises(CheckpointException, match="Unknown extension"):
        dcp.load({"model": job.model.state_dict()}, storage_reader=FileSystemReader(step_dir),
                 planner=DefaultLoadPlanner(allow_partial_load=True), no_dist=True)

    monkeypatch.setattr(Writer, "write_data", FileSystemWriter.write_data)
    old = manager(tmp_path / "stock", async_mode="off")
    old.save(1, job.state())
    old.close()
    monkeypatch.undo()

    def archives(root: str) -> int:
        return (tmp_path / root / "step_000000001" / "__0_0.distcp").read_bytes().count(
            b"PK\x05\x06")

    tensors = len(job.model.state_dict()) + 3 * len(job.optimizer.state)
    assert archives("stock") - archives("raw") == tensors == archives("dcp") - archives("raw")
    for root in ("stock", "dcp", "raw"):
        step, loaded = load_into_fresh(manager(tmp_path / root))
        assert step == 1 and same(loaded, job.snapshot()), root


CORRUPTIONS = {
    "truncated shard": lambda d, root: os.truncate(d / "__0_0.distcp", 100),
    "flipped byte": lambda d, root: flip_byte(d / "__0_0.distcp"),
    "missing shard": lambda d, root: os.remove(d / "__0_0.distcp"),
    "missing marker": lambda d, root: os.remove(d / "commit_rank_0.json"),
    "missing metadata": lambda d, root: os.remove(d / ".metadata"),
    "shard from another step": lambda d, root: shutil.copy(
        root / "step_000000001" / "__0_0.distcp", d / "__0_0.distcp"),
    "marker from another step": lambda d, root: shutil.copy(
        root / "step_000000001" / "commit_rank_0.json", d / "commit_rank_0.json"),
}


@pytest.mark.parametrize("corruption", sorted(CORRUPTIONS))
def test_a_damaged_newest_checkpoint_falls_back_to_the_previous_one(tmp_path, corruption,
                                                                    caplog):
    root, first = two_checkpoints(tmp_path)
    CORRUPTIONS[corruption](root / "step_000000002", root)
    with caplog.at_level(logging.WARNING):
        step, loaded = load_into_fresh(manager(root))
    assert step == 1 and same(loaded, first)
    skipped = [r.getMessage() for r in our_records(caplog) if "incomplete" in r.getMessage()]
    assert len(skipped) == 1 and "step_000000002" in skipped[0]


def test_a_marker_of_earlier_versions_with_sha256_still_verifies(tmp_path, capsys):
    """Markers written before XXH3 recorded sha256, as below: such a checkpoint still loads
    and `checkpointing.verify` passes it, and a flipped bit in it is still caught."""
    root, first = two_checkpoints(tmp_path)
    step_dir = root / "step_000000002"
    files = {name: {"size": (step_dir / name).stat().st_size,
                    "sha256": hashlib.sha256((step_dir / name).read_bytes()).hexdigest()}
             for name in (".metadata", "__0_0.distcp")}
    (step_dir / "commit_rank_0.json").write_text(json.dumps(
        {"files": files, "rank": 0, "step": 2, "world_size": 1}, indent=1, sort_keys=True))
    assert verify.main([str(root)]) == 0
    assert capsys.readouterr().out.splitlines()[0].startswith("step_000000002  complete")
    assert load_into_fresh(manager(root))[0] == 2
    flip_byte(step_dir / "__0_0.distcp")
    step, loaded = load_into_fresh(manager(root))
    assert step == 1 and same(loaded, first)


HOSTILE_ENTRIES = {
    "unknown algorithm": lambda size, digest: {"size": size, "blake3": digest},
    "no checksum": lambda size, digest: {"size": size},
    "two checksums": lambda size, digest: {"size": size, "xxh3_64": digest,
                                           "sha256": "0" * 64},
    "short digest": lambda size, digest: {"size": size, "xxh3_64": digest[:-1]},
    "not hex": lambda size, digest: {"size": size, "xxh3_64": "z" * 16},
    "a number": lambda size, digest: {"size": size, "xxh3_64": 12345},
    "a list": lambda size, digest: [size, digest],
}


@pytest.mark.parametrize("entry", sorted(HOSTILE_ENTRIES))
def test_a_marker_entry_without_a_checksum_it_can_check_falls_back(tmp_path, caplog, entry):
    root, first = two_checkpoints(tmp_path)
    path = root / "step_000000002" / "commit_rank_0.json"
    body = json.loads(path.read_text())
    record = body["files"]["__0_0.distcp"]
    body["files"]["__0_0.distcp"] = HOSTILE_ENTRIES[entry](record["size"], record["xxh3_64"])
    path.write_text(json.dumps(body))
    with caplog.at_level(logging.WARNING):
        step, loaded = load_into_fresh(manager(root))
    assert step == 1 and same(loaded, first)
    skipped = [r.getMessage() for r in our_records(caplog) if "incomplete" in r.getMessage()]
    assert len(skipped) == 1 and "commit_rank_0.json is unreadable" in skipped[0], skipped
    assert "\n" not in skipped[0]


HOSTILE_BODIES = {
    "size inf": lambda body: body["files"]["__0_0.distcp"].update(size=math.inf),
    "size 1e400": lambda body: body["files"]["__0_0.distcp"].update(size="1e400"),
    "size -inf": lambda body: body["files"]["__0_0.distcp"].update(size=-math.inf),
    "world size 10**7": lambda body: body.update(world_size=10 ** 7),
    "world size 0": lambda body: body.update(world_size=0),
    "world size -1": lambda body: body.update(world_size=-1),
    "world size inf": lambda body: body.update(world_size=math.inf),
}


@pytest.mark.parametrize("change", sorted(HOSTILE_BODIES))
def test_a_marker_with_impossible_numbers_falls_back_in_one_short_line(tmp_path, caplog,
                                                                      change):
    # float("1e400") is inf, and int(inf) raises OverflowError, not ValueError
    root, first = two_checkpoints(tmp_path)
    path = root / "step_000000002" / "commit_rank_0.json"
    body = json.loads(path.read_text())
    HOSTILE_BODIES[change](body)
    path.write_text(json.dumps(body).replace('"1e400"', "1e400"))
    with caplog.at_level(logging.WARNING):
        step, loaded = load_into_fresh(manager(root))
    assert step == 1 and same(loaded, first)
    skipped = [r.getMessage() for r in our_records(caplog) if "incomplete" in r.getMessage()]
    assert len(skipped) == 1 and "step_000000002" in skipped[0], skipped
    assert len(skipped[0]) < 400 and "\n" not in skipped[0]


def test_when_no_checkpoint_is_valid_nothing_is_loaded(tmp_path):
    root, _ = two_checkpoints(tmp_path)
    for step_dir in root.iterdir():
        flip_byte(step_dir / "__0_0.distcp")
    mgr = manager(root)
    job = Job(seed=5)
    before = job.snapshot()
    assert mgr.load_latest(job.state()) is None
    assert mgr.has_any_checkpoint()  # the trainer turns this into an error (test_resume)
    assert same(job.snapshot(), before)


def test_newest_means_the_highest_step_not_the_newest_file(tmp_path):
    root, _ = two_checkpoints(tmp_path)
    old = root / "step_000000001"
    os.utime(old, (time.time() + 1000, time.time() + 1000))
    assert next(commit.find_complete(Store(str(root))))[0] == 2


def test_a_hostile_metadata_pickle_is_never_run(tmp_path):
    import pickle

    root, first = two_checkpoints(tmp_path)
    marker = tmp_path / "pwned"
    (root / "step_000000002" / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    rewrite_marker(root / "step_000000002")
    step, loaded = load_into_fresh(manager(root))
    assert not marker.exists()
    assert step == 1 and same(loaded, first)


def test_a_hostile_non_tensor_item_is_never_run(tmp_path, caplog):
    marker = tmp_path / "pwned"
    root = tmp_path / "ckpt"
    mgr = manager(root, async_mode="off")
    job = Job()
    mgr.save(1, with_planted_step(job, marker))
    assert not marker.exists()
    with caplog.at_level(logging.WARNING):
        assert manager(root).load_latest(Job().state()) is None  # skipped, not run
    assert "refusing to load item position.trainer.step" in caplog.text
    assert not marker.exists()
    # The control: DCP's own loader does run it, so this test guards a real hole.
    dcp.load({"position": {"trainer": {"step": 0}}},
             storage_reader=FileSystemReader(root / "step_000000001"),
             planner=DefaultLoadPlanner(allow_partial_load=True), no_dist=True)
    assert marker.exists()


def test_retention_keeps_the_newest_and_cleans_leftovers(tmp_path):
    job = Job()
    root = tmp_path / "ckpt"
    mgr = manager(root, async_mode="thread", keep_last=2)
    for step in (1, 2, 3):
        mgr.save(step, job.state())
        mgr.wait()
    (root / ".step_000000004.partial-dead").mkdir()  # left by a crash
    (root / "step_000000000").mkdir()  # an incomplete step directory
    mgr.save(5, job.state())
    mgr.close()
    assert sorted(os.listdir(root)) == ["step_000000003", "step_000000005"]


@pytest.mark.parametrize("local_rank", [0, 1])
def test_a_node_without_rank_0_cleans_its_own_staging_partials(tmp_path, local_rank):
    """Rank 0 renames and retains its own node's staged copies only. On another node the
    lowest local rank removes the partials of earlier saves and of dead trainers, and the
    last one once the run closes; no other local rank touches them."""
    stage = tmp_path / "stage"
    (stage / ".step_000000001.partial-dead").mkdir(parents=True)  # left by a crash
    job = Job()
    mgr = CheckpointManager(CheckpointOptions(dir=str(tmp_path / "ckpt"), staging_dir=str(stage)),
                            rank=1, world_size=2, local_rank=local_rank)
    for step in (2, 3):
        mgr.save(step, job.state())
        mgr.wait()
    staged = [commit.partial_dir_name(s, mgr.attempt) for s in (2, 3)]
    assert sorted(os.listdir(stage)) == (
        staged[1:] if local_rank == 0 else [".step_000000001.partial-dead", *staged])
    mgr.close()
    assert len(os.listdir(stage)) == (0 if local_rank == 0 else 3)


def test_a_failed_save_never_pushes_out_a_good_checkpoint(tmp_path, caplog):
    job = Job()
    root = tmp_path / "ckpt"

    def fail_third(phase: str, step: int) -> None:
        if step in (3, 6) and phase == "uploaded":
            raise OSError("No space left on device")

    mgr = CheckpointManager(CheckpointOptions(dir=str(root), keep_last=2), fault_hook=fail_third)
    for step in (1, 2):
        mgr.save(step, job.state())
    third = mgr.save(3, job.state())
    with caplog.at_level(logging.ERROR):
        assert mgr.wait() is False
    assert "No space left on device" in caplog.text and not third.result().committed
    assert [s for s, _ in commit.find_complete(Store(str(root)))] == [2, 1]
    mgr.save(4, job.state())
    mgr.close()
    assert sorted(os.listdir(root)) == ["step_000000002", "step_000000004"]
    mgr.save(5, job.state())
    mgr.save(6, job.state())  # the final save fails: close() must say so
    with pytest.raises(CheckpointError, match="final checkpoint"):
        mgr.close()


class LookedAt(CheckpointManager):
    """A manager whose background commit hands `look` a turn after each attribute it writes:
    every moment at which the trainer's per-step poll could see it half-way."""

    def __setattr__(self, name: str, value) -> None:
        super().__setattr__(name, value)
        if threading.current_thread() is not threading.main_thread():
            self.__dict__.get("look", lambda: None)()


def test_each_save_is_recorded_with_its_own_duration(tmp_path):
    """The trainer polls the save in flight at each step. A poll while the background commit
    is half-way once took that save's step from the manager and its duration from the one
    before (the manager set the step first): a `save_committed` off by a whole save."""
    cfg = compose_config(["+experiment=resnet", "logger=none", "checkpoint.interval_steps=2",
                          f"checkpoint.dir={tmp_path / 'ck'}"])
    held, release = threading.Event(), threading.Event()

    def hold_the_second(phase: str, step: int) -> None:
        if phase == "committing" and step == 4:
            held.set()
            release.wait(60)

    mgr = LookedAt(CheckpointOptions(dir=str(tmp_path / "ck"), async_mode="thread"),
                   fault_hook=hold_the_second)
    checkpoints = RunCheckpoints(cfg, mgr, {"run": RunInfo(None, {})}, DataIdentity(0, 1, 1),
                                 world_size=1)
    events.open_timeline(tmp_path, rank=0, world_size=1, started_at=time.time())
    try:
        checkpoints.save(Position(step=2))
        checkpoints.save(Position(step=4))  # records step 2's, which it waited for
        assert held.wait(60)
        first = next(e["seconds"] for e in events.read_events(tmp_path / "events.jsonl").events
                     if e.kind == "save_committed")
        mgr.look = lambda: checkpoints.save(Position(step=4))  # a poll: no save is due
        began = time.perf_counter()
        threading.Event().wait(first + 0.05)  # the second save takes longer than the first
        held_for = time.perf_counter() - began
        release.set()
        checkpoints.close()
    finally:
        release.set()
        events.close()
    committed = {e["step"]: e["seconds"] for e in
                 events.read_events(tmp_path / "events.jsonl").events
                 if e.kind == "save_committed"}
    assert committed[2] == first and committed[4] >= held_for > first


def test_options_are_validated():
    with pytest.raises(ValueError, match="keep at least 2"):
        CheckpointOptions(dir="x", keep_last=1)
    with pytest.raises(ValueError, match="async_mode"):
        CheckpointOptions(dir="x", async_mode="threads")


def test_a_checkpoint_dir_on_an_fsspec_url_round_trips(tmp_path):
    url = f"memory://ckpt-{tmp_path.name}"
    job = Job()
    mgr = CheckpointManager(CheckpointOptions(dir=url, async_mode="thread"))
    mgr.save(1, job.state())
    mgr.close()
    fresh = CheckpointManager(CheckpointOptions(dir=url))  # a new node: no local copy
    other = Job(seed=9)
    assert fresh.load_latest(other.state()).step == 1
    assert same(other.snapshot(), job.snapshot())


def test_a_damaged_local_copy_is_not_loaded(tmp_path):
    job = Job()
    options = dict(async_mode="off", staging_dir=str(tmp_path / "stage"))
    mgr = manager(tmp_path / "ckpt", **options)
    mgr.save(1, job.state())
    flip_byte(tmp_path / "stage" / "step_000000001" / "__0_0.distcp")
    other = Job(seed=9)
    assert manager(tmp_path / "ckpt", **options).load_latest(other.state()).step == 1
    assert same(other.snapshot(), job.snapshot())  # read from the verified remote copy


def test_retention_spares_a_partial_another_rank_is_already_writing(tmp_path):
    """Rank 0 applies retention after committing step 1, while another rank may already have
    created its partial of step 2 (its save starts before DCP's collective): that one stays;
    a dead attempt's leftover and this attempt's older partials go."""
    root = tmp_path / "ckpt"
    mgr = manager(root, async_mode="off")
    ahead = root / commit.partial_dir_name(2, mgr.attempt)
    stale = [root / commit.partial_dir_name(2, "0-deadbeef"),
             root / commit.partial_dir_name(0, mgr.attempt)]
    for path in [ahead, *stale]:
        path.mkdir(parents=True)
    mgr.save(1, Job().state())
    mgr.close()
    assert ahead.is_dir() and not any(p.exists() for p in stale)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """A tensor's values as bytes, so that NaN payloads and -0.0 compare too."""
    if t.is_quantized:
        return _bits(t.int_repr())
    return t.resolve_conj().resolve_neg().contiguous().reshape(-1).view(torch.uint8)


def _like(t: torch.Tensor) -> torch.Tensor:
    """A tensor of `t`'s kind that loading must fill: zeros, or another quantized value."""
    if t.is_quantized:
        return torch.quantize_per_tensor(torch.ones(t.shape), t.q_scale(), t.q_zero_point(),
                                         t.dtype)
    return torch.zeros_like(t, memory_format=torch.preserve_format).resolve_conj()


_SHARED = torch.randn(4, 6)
ODD_TENSORS = {
    "bfloat16": lambda: {"t": torch.randn(5, 3).bfloat16()},
    "float8": lambda: {"a": torch.randn(9).to(torch.float8_e4m3fn),
                       "b": torch.randn(9).to(torch.float8_e5m2)},
    "nan and -0.0": lambda: {"t": torch.tensor([float("nan"), -0.0, float("inf")])},
    "bool": lambda: {"t": torch.rand(7) > 0.5},
    "complex": lambda: {"t": torch.randn(3, dtype=torch.complex64)},
    "conjugate view": lambda: {"t": torch.randn(3, dtype=torch.complex64).conj()},
    "negative view": lambda: {"t": torch._neg_view(torch.randn(3, dtype=torch.complex64))},
    "quantized": lambda: {"t": torch.quantize_per_tensor(torch.randn(6), 0.1, 2, torch.qint8)},
    "transposed": lambda: {"t": torch.randn(4, 6).t()},
    "channels_last": lambda: {"t": torch.randn(2, 3, 4, 5).to(
        memory_format=torch.channels_last)},
    "every third": lambda: {"t": torch.randn(10)[::3]},
    "zero-size": lambda: {"a": torch.empty(0, 5), "b": torch.empty(3, 0, 2)},
    "0-dim": lambda: {"a": torch.tensor(3.5), "b": torch.tensor(7)},
    "tied": lambda: {"a": _SHARED, "b": _SHARED, "c": _SHARED[1:3]},
}


@pytest.mark.parametrize("mode,format", [("off", "dcp"), ("thread", "dcp"), ("off", "raw")])
@pytest.mark.parametrize("kind", sorted(ODD_TENSORS))
def test_odd_tensors_round_trip_bit_exact(tmp_path, kind, mode, format):
    """The writer stores a tensor's bytes: any dtype, layout, view or sharing of storage
    must come back with the same bits (a conjugate view holds its values unconjugated; a
    quantized tensor's bytes mean nothing without its scale), through our reader and, in
    the standard format, DCP's stock one."""
    tensors = ODD_TENSORS[kind]()
    mgr = manager(tmp_path / "ckpt", async_mode=mode, format=format)
    mgr.save(1, {"s": dict(tensors)})
    mgr.close()
    loaded = {k: _like(v) for k, v in tensors.items()}
    assert manager(tmp_path / "ckpt").load_latest({"s": loaded}).step == 1
    stock = {k: _like(v) for k, v in tensors.items()}
    if format == "dcp":
        dcp.load({"s": stock}, checkpoint_id=str(tmp_path / "ckpt" / "step_000000001"),
                 no_dist=True)
    for k, v in tensors.items():
        assert torch.equal(_bits(loaded[k]), _bits(v)), k
        assert format != "dcp" or torch.equal(_bits(stock[k]), _bits(v)), k


def test_each_tensor_record_is_the_archive_torch_save_writes(tmp_path, monkeypatch):
    """The writer frames each tensor's bytes itself (checkpointing.archive) rather than
    calling torch.save per tensor on every save: its records must be, byte for byte, the
    archives torch.save writes (CRC32s off) for the tensor as stored (a plain contiguous
    copy; a quantized one through torch.save itself), zip files that torch.load reads back;
    and a later save of tensors of the same dtypes and shapes calls torch.save for none."""
    tensors = {f"{kind}/{k}": v for kind, make in sorted(ODD_TENSORS.items())
               for k, v in make().items()}
    saved: list = []
    save = torch.save
    monkeypatch.setattr(torch, "save", lambda obj, *a, **kw: (
        saved.append(obj) if isinstance(obj, torch.Tensor) else None, save(obj, *a, **kw))[1])
    mgr = manager(tmp_path / "ckpt", async_mode="off")
    mgr.save(1, {"s": dict(tensors)})
    saved.clear()
    mgr.save(2, {"s": dict(tensors)})
    mgr.close()
    monkeypatch.undo()
    assert [t.dtype for t in saved] == [torch.qint8], "only the quantized tensor is pickled"
    step_dir = tmp_path / "ckpt" / "step_000000002"
    with open(step_dir / ".metadata", "rb") as f:
        metadata = load_metadata(f)
    shard = (step_dir / "__0_0.distcp").read_bytes()
    for key, tensor in tensors.items():
        index = next(i for i in metadata.storage_data if i.fqn == f"s.{key}")
        info = metadata.storage_data[index]
        record = shard[info.offset:info.offset + info.length]
        stored = tensor if tensor.is_quantized else (
            tensor.resolve_conj().resolve_neg().contiguous().clone())
        expected = io.BytesIO()
        with no_crc32():
            torch.save(stored, expected)
        assert record == expected.getvalue(), key
        with zipfile.ZipFile(io.BytesIO(record)) as archive:
            assert archive.namelist()[0] == "archive/data.pkl", key
        assert torch.equal(_bits(torch.load(io.BytesIO(record), weights_only=True)),
                           _bits(tensor)), key


def test_a_frame_past_4_gb_is_torch_s_zip64_archive(tmp_path):
    """A tensor of 4 GB or more needs zip64 records, which the cached frame takes from
    torch itself: stock zipfile and torch.load read the archive (its bytes a sparse hole
    here, never allocated)."""
    nbytes = (1 << 32) + 3
    head, tail = tensor_archive(torch.uint8, (nbytes,))
    path = tmp_path / "big.pt"
    with open(path, "wb") as f:
        f.write(head)
        f.seek(nbytes - 1, os.SEEK_CUR)
        f.write(b"\x07")
        f.write(tail)
    with zipfile.ZipFile(path) as archive:
        assert archive.getinfo("archive/data/0").file_size == nbytes
    loaded = torch.load(path, mmap=True, weights_only=True)
    assert loaded.shape == (nbytes,) and loaded[-1] == 7 and loaded[0] == 0


def test_dcp_s_own_writer_s_strided_records_load_bit_exact(tmp_path, monkeypatch):
    """DCP's own writer archives a tensor's storage as it lies (channels_last, transposed):
    our reader must not take those bytes for C order, but load them as DCP does."""
    tensors = {**ODD_TENSORS["channels_last"](), "tt": torch.randn(4, 6).t(),
               **{f"q{k}": v for k, v in ODD_TENSORS["quantized"]().items()}}
    monkeypatch.setattr(Writer, "write_data", FileSystemWriter.write_data)
    mgr = manager(tmp_path / "ckpt", async_mode="off")
    mgr.save(1, {"s": dict(tensors)})
    mgr.close()
    monkeypatch.undo()
    loaded = {k: _like(v) for k, v in tensors.items()}
    assert manager(tmp_path / "ckpt").load_latest({"s": loaded}).step == 1
    for k, v in tensors.items():
        assert torch.equal(_bits(loaded[k]), _bits(v)), k

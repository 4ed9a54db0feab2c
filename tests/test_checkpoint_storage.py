"""Checkpoint storage that cannot be written: found at start (one line, exit code 2, before
any step), and a full disk during a save reported in one line that names the cause and the
room needed, never with DCP's tracebacks."""

from __future__ import annotations

import errno
import logging
import os
import re
import time
from collections import namedtuple
from pathlib import Path

import pytest
import torch

from checkpointing import export, manager as manager_module, verify, writer
from checkpointing.manager import CheckpointError, CheckpointManager, CheckpointOptions
from checkpointing.storage import Store
from support.launch import run_train
from support.runs import tiny_overrides
from support.tiny_job import Job, load_into_fresh, manager, same, two_checkpoints
from support.logs import our_records

BIG = 1 << 20  # floats: a 4.2 MB tensor, so sizes show in the messages' MB


def unwritable_places(tmp_path: Path) -> dict:
    """Directories no process can create or write, root included: a path through a file,
    and a file where a directory should be."""
    a_file = tmp_path / "a_file"
    a_file.write_text("not a directory")
    return {"under a file": a_file / "ck", "a file": a_file}


def test_an_unwritable_checkpoint_dir_stops_the_run_before_any_step(tmp_path, tiny_root):
    ck = unwritable_places(tmp_path)["under a file"]
    began = time.monotonic()
    result = run_train([*tiny_overrides(tiny_root), "logger=none", "trainer.device=cpu",
                        "model=tiny_cnn", f"run.root={tmp_path / 'runs'}",
                        f"checkpoint.dir={ck}"], cwd=tmp_path, timeout=120)
    assert result.returncode == 2, result.stderr[-2000:]
    assert time.monotonic() - began < 30
    errors = [line for line in result.stderr.splitlines() if "error" in line.lower()]
    assert errors == [f"error: checkpoint.dir={ck} is not a writable directory "
                      f"(NotADirectoryError: [Errno 20] Not a directory: '{ck}'): point "
                      f"checkpoint.dir at one this process can write"]
    assert "Traceback" not in result.stderr and "step 1/" not in result.stderr


@pytest.mark.parametrize("place", ["under a file", "a file"])
@pytest.mark.parametrize("tier", ["dir", "staging_dir"])
def test_each_tier_is_checked_for_writing_at_start(tmp_path, place, tier):
    bad = unwritable_places(tmp_path)[place]
    paths = {"dir": str(tmp_path / "ck"), "staging_dir": str(tmp_path / "stage"), tier: str(bad)}
    mgr = CheckpointManager(CheckpointOptions(**paths))
    with pytest.raises(CheckpointError, match=rf"^checkpoint\.{tier}={re.escape(str(bad))} is "
                                              rf"not a writable directory \(\w+Error: "):
        mgr.check_storage()


def test_writable_tiers_pass_and_are_created_without_leftovers(tmp_path):
    mgr = CheckpointManager(CheckpointOptions(dir=str(tmp_path / "new" / "ck"),
                                              staging_dir=str(tmp_path / "new" / "stage")))
    mgr.check_storage()
    assert os.listdir(tmp_path / "new" / "ck") == [] == os.listdir(tmp_path / "new" / "stage")
    CheckpointManager(CheckpointOptions(dir=f"memory://ck-{tmp_path.name}")).check_storage()


def test_a_url_fsspec_cannot_open_is_one_line_in_the_tools(tmp_path, capsys):
    assert verify.main(["nosuchprotocol://bucket/ck"]) == 2
    assert export.main(["nosuchprotocol://bucket/ck", str(tmp_path / "m.pt")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: cannot open nosuchprotocol://bucket/ck: Protocol not known: "
                   "nosuchprotocol (a URL needs its fsspec package, e.g. s3fs for s3://)"] * 2


def fail_writes(monkeypatch: pytest.MonkeyPatch, error: BaseException) -> None:
    """Every write of a checkpoint item fails with `error`, inside DCP, as a full disk makes
    it fail."""
    def write_item(*args, **kwargs):
        raise error
    monkeypatch.setattr(writer, "_write_item", write_item)


def big_state(job: Job) -> dict:
    return {**job.state(), "big": torch.zeros(BIG)}


Usage = namedtuple("Usage", "total used free")


@pytest.mark.parametrize("mode", ["off", "thread"])
@pytest.mark.parametrize("errno_", [errno.ENOSPC, errno.EDQUOT])
def test_a_full_disk_is_one_line_naming_the_cause_and_the_room(tmp_path, monkeypatch, caplog,
                                                               mode, errno_):
    root = tmp_path / "ck"
    mgr = CheckpointManager(CheckpointOptions(dir=str(root), async_mode=mode, keep_last=2))
    job = Job()
    mgr.save(1, big_state(job))
    assert mgr.wait()
    size = sum(p.stat().st_size for p in (root / "step_000000001").iterdir()
               if p.name != "commit_rank_0.json")
    fail_writes(monkeypatch, OSError(errno_, os.strerror(errno_)))
    with caplog.at_level(logging.WARNING):
        mgr.save(2, big_state(job))  # mid-run: logged, training goes on
        assert mgr.wait() is False
        mgr.save(3, big_state(job))  # the final one: raised
        with pytest.raises(CheckpointError) as final:
            mgr.close()
    expected = (f"no space left on device at {root}: checkpoint.keep_last=2 needs about "
                f"{3 * size / 1e6:.1f} MB (3 checkpoints of about {size / 1e6:.1f} MB), the "
                f"kept ones and the next; ")
    assert [r.levelno for r in our_records(caplog)] == [logging.ERROR]
    logged = our_records(caplog)[0].getMessage()
    assert logged.startswith(f"checkpoint at step 2 failed: {expected}")
    assert "\n" not in logged and our_records(caplog)[0].exc_info is None
    assert str(final.value).startswith(f"the final checkpoint (step 3) failed: {expected}")
    assert "\n" not in str(final.value)
    assert sorted(os.listdir(root)) == ["step_000000001"]  # the failed saves' room is freed


@pytest.mark.parametrize("staging", [False, True])
def test_a_short_write_on_a_full_disk_is_named_too(tmp_path, monkeypatch, staging):
    """torch's zip writer reports a full disk as a RuntimeError without an errno; with no
    complete checkpoint yet, the room comes from the size of the state being saved."""
    root, stage = tmp_path / "ck", tmp_path / "stage"
    fail_writes(monkeypatch, RuntimeError("[enforce fail at inline_container.cc:672] . "
                                          "unexpected pos 704 vs 598"))
    monkeypatch.setattr(manager_module.shutil, "disk_usage",
                        lambda path: Usage(10 ** 9, 10 ** 9 - 1000, 1000))
    mgr = CheckpointManager(CheckpointOptions(dir=str(root), async_mode="thread",
                                              staging_dir=str(stage) if staging else None))
    mgr.save(1, {"big": torch.zeros(BIG)})
    where, key = (stage, "staging_dir") if staging else (root, "dir")
    with pytest.raises(CheckpointError, match=re.escape(
            f"failed: no space left on device at {where}: checkpoint.keep_last=3 needs about "
            f"{4 * BIG * 4 / 1e6:.1f} MB (4 checkpoints of about {BIG * 4 / 1e6:.1f} MB), the "
            f"kept ones and the next; 0.0 MB free: free some space, lower "
            f"checkpoint.keep_last or point checkpoint.{key} elsewhere")):
        mgr.close()


def test_other_save_failures_are_one_line_too(tmp_path, monkeypatch):
    fail_writes(monkeypatch, PermissionError(errno.EACCES, "Permission denied", "/x/y"))
    mgr = CheckpointManager(CheckpointOptions(dir=str(tmp_path / "ck"), async_mode="thread"))
    mgr.save(1, Job().state())
    with pytest.raises(CheckpointError) as final:
        mgr.close()
    assert str(final.value) == ("the final checkpoint (step 1) failed: PermissionError: "
                                "[Errno 13] Permission denied: '/x/y'")


def test_a_checkpoint_that_cannot_be_read_is_skipped_with_one_line(tmp_path, monkeypatch,
                                                                  caplog):
    """An I/O error that outlasts the store's retries (a dying disk, a lost mount) makes
    that checkpoint unusable, not the resume: the next older one is loaded."""
    root, first = two_checkpoints(tmp_path)
    read = Store.read_bytes

    def failing(self, path):
        if "step_000000002" in path:
            raise OSError(errno.EIO, "Input/output error", path)
        return read(self, path)
    monkeypatch.setattr(Store, "read_bytes", failing)
    with caplog.at_level(logging.WARNING):
        step, loaded = load_into_fresh(manager(root))
    assert step == 1 and same(loaded, first)
    assert len(our_records(caplog)) == 1 and "Input/output error" in our_records(caplog)[0].getMessage()


def test_a_small_file_that_does_not_fit_leaves_nothing_behind(tmp_path, monkeypatch):
    """Markers and the start-up probe are written by temp + rename: a full disk must not
    leave the temp file taking room (it would never be cleaned)."""
    def full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr("checkpointing.storage.os.fsync", full)
    with pytest.raises(OSError, match="No space left"):
        Store(str(tmp_path)).check_writable()
    assert os.listdir(tmp_path) == []


def test_an_upload_that_arrives_altered_fails_its_save_and_the_next_one_lands(
        tmp_path, monkeypatch, caplog):
    """Each rank reads back what it uploaded before its marker vouches for it (so rank 0's
    retention never downloads a whole checkpoint): a copy that does not match the checksums
    taken as it was written is a failed upload, never a committed checkpoint."""
    put = Store.put

    def altering(self, local_file, path):
        put(self, local_file, path)
        if path.endswith(".distcp"):
            with open(path, "r+b") as f:
                f.seek(100)
                byte = f.read(1)
                f.seek(100)
                f.write(bytes([byte[0] ^ 0xFF]))

    monkeypatch.setattr(Store, "put", altering)
    root = tmp_path / "ck"
    mgr = CheckpointManager(CheckpointOptions(dir=str(root), staging_dir=str(tmp_path / "stage"),
                                              async_mode="off"))
    job = Job()
    with caplog.at_level(logging.WARNING):
        failed = mgr.save(1, job.state()).result()
    assert not failed.committed and "__0_0.distcp does not match its checksum" in failed.error
    lines = [r.getMessage() for r in our_records(caplog)]
    assert lines == [f"checkpoint at step 1 failed: {failed.error} (the newest complete one "
                     f"is none)"], lines
    assert not list(root.iterdir())  # nothing half-uploaded is left to be trusted
    monkeypatch.setattr(Store, "put", put)
    assert mgr.save(2, job.state()).result().committed
    mgr.close()
    assert [p.name for p in root.iterdir()] == ["step_000000002"]

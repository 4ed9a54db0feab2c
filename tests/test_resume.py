"""Crash and resume with real processes: SIGKILL at random steps and inside a background
save, then the same command again. The run must end bit-identical to one that was never
interrupted: model, optimizer, scheduler, data position and RNG, and the same samples."""

from __future__ import annotations

import os
import random
import signal
import time
from pathlib import Path
from typing import List

import pytest

from checkpointing import commit
from checkpointing.storage import Store
from support.checkpoints import (assert_matches_reference, assert_same_contents,
                                 checkpoint_contents, complete_now, reference_of)
from support.launch import PYTHON, finish, launch, run_job
from support.ledger import assert_resumed, ledger_records, samples_per_rank
from support.mount import rclone_mount
from support.runs import FINAL, tiny_overrides
from support.shared import made_once


def command(tiny_root: Path, run_root: Path, *extra: str) -> List[str]:
    # Dropout in the head makes training draw from the global RNG, and 2 workers decode
    # ahead of the loop: both must be handled for resume to be exact.
    return ["-m", "train", "+experiment=resnet", *tiny_overrides(tiny_root),
            "logger=none", "model.dropout=0.3", "data.num_workers=2",
            "checkpoint.interval_steps=3", f"audit.ledger={run_root / 'ledger.jsonl'}",
            f"run.root={run_root}", "run.name=r", *extra]


def run_to_end(args: List[str], fault: str = "") -> str:
    return run_job(PYTHON, args, fault, timeout=180)


def killed_run(args: List[str], fault: str) -> None:
    """A run that its own fault injection SIGKILLs."""
    proc = launch(PYTHON, args, fault)
    out = finish(proc, timeout=180)
    assert proc.returncode == -signal.SIGKILL, f"exit {proc.returncode}:\n{out[-3000:]}"


def kill_after_steps(args: List[str], ledger: Path, steps: int, fault: str = "",
                     after_commit: Store | None = None) -> None:
    """SIGKILL the run from outside once its ledger has `steps` more lines (and, with
    `after_commit`, once it has committed a checkpoint, so that every life makes progress:
    a save takes longer than a few of these tiny steps)."""
    before = len(ledger_records(ledger))
    committed = set(commit.committed_steps(after_commit)) if after_commit else set()
    proc = launch(PYTHON, args, fault)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        new_commit = not after_commit or set(commit.committed_steps(after_commit)) - committed
        if new_commit and len(ledger_records(ledger)) - before >= steps:
            os.killpg(proc.pid, signal.SIGKILL)
            break
        time.sleep(0.01)
    finish(proc, timeout=180)
    assert proc.returncode == -signal.SIGKILL, "the run ended before it could be killed"


@pytest.fixture(scope="module")
def reference(tiny_root, tmp_path_factory):
    """The uninterrupted run, made once however many xdist workers run these tests."""
    return reference_of(made_once(tmp_path_factory, "reference_resume",
                                  lambda root: run_to_end(command(tiny_root, root))))


def test_repeated_kills_at_random_steps_end_bit_identical(tiny_root, tmp_path, reference):
    args = command(tiny_root, tmp_path, "checkpoint.keep_last=2")
    ledger = tmp_path / "ledger.jsonl"
    rng = random.Random(20261130)
    store = Store(str(tmp_path / "r" / "checkpoints"))
    restarts = []
    for _ in range(3):
        kill_after_steps(args, ledger, rng.randint(1, 4), after_commit=store)
        # Retention under kills: whatever instant it died at, a complete checkpoint is left.
        assert next(commit.find_complete(store), None) is not None
        restarts.append((time.time(), complete_now(store)))
    run_to_end(args)
    for since, committed in restarts:  # each of the three restarts resumed
        assert_resumed(ledger, since, committed)
    assert_matches_reference(tmp_path, reference)


@pytest.mark.parametrize("phase", ["uploading", "committing"])
def test_a_kill_inside_a_background_save_loses_nothing(tiny_root, tmp_path, reference, phase):
    args = command(tiny_root, tmp_path, f"checkpoint.staging_dir={tmp_path / 'staging'}")
    killed_run(args, fault=f"kill:save=2:phase={phase}")
    store = Store(str(tmp_path / "r" / "checkpoints"))
    assert [s for s, _ in commit.find_complete(store)] == [3]  # save 2 (step 6) never landed
    since, committed = time.time(), complete_now(store)
    run_to_end(args)
    assert assert_resumed(tmp_path / "ledger.jsonl", since, committed) == 3
    assert_matches_reference(tmp_path, reference)
    assert not [n for n in os.listdir(store.root) if "partial" in n]  # cleaned after commit


def test_process_based_async_save_resumes_exactly(tiny_root, tmp_path, reference):
    args = command(tiny_root, tmp_path, "checkpoint.async_mode=process")
    store = Store(str(tmp_path / "r" / "checkpoints"))
    kill_after_steps(args, tmp_path / "ledger.jsonl", 2, after_commit=store)
    since, committed = time.time(), complete_now(store)
    out = run_to_end(args)
    assert_resumed(tmp_path / "ledger.jsonl", since, committed)
    assert_matches_reference(tmp_path, reference)
    # DCP's saver process saves single-process on purpose too: no warning of it there either
    assert "torch.distributed is disabled" not in out


@pytest.mark.parametrize("omitted, what_differs", [
    ("rng", "model."),  # dropout masks come from the RNG: the weights drift
    ("data", "samples"),  # the sampler restarts its epoch: other samples
])
def test_negative_controls_leaving_state_out_breaks_equivalence(tiny_root, tmp_path, reference,
                                                               omitted, what_differs):
    args = command(tiny_root, tmp_path)
    kill_after_steps(args, tmp_path / "ledger.jsonl", 2, fault=f"omit:keys={omitted}",
                     after_commit=Store(str(tmp_path / "r" / "checkpoints")))
    run_to_end(args, fault=f"omit:keys={omitted}")
    if what_differs == "samples":
        assert samples_per_rank(tmp_path / "ledger.jsonl") != reference["samples"]
    else:
        final = checkpoint_contents(tmp_path / "r" / "checkpoints" / FINAL)
        with pytest.raises(AssertionError):
            assert_same_contents(final, reference["contents"], what_differs)


def test_resume_modes_and_no_valid_checkpoint_are_clear_errors(tiny_root, tmp_path):
    args = command(tiny_root, tmp_path, "trainer.max_steps=3")
    out = run_job(PYTHON, [*args, "checkpoint.resume=required"], expect=2)
    assert "checkpoint.resume=required" in out
    run_to_end(args)
    out = run_job(PYTHON, [*args, "checkpoint.resume=never"], expect=2)
    assert "checkpoint.resume=never" in out
    out = run_job(PYTHON, [*args, "model.name=resnet34"], expect=2)
    assert "model.name changed since the checkpoint" in out
    out = run_job(PYTHON, [*args, "optim=sgd"], expect=2)  # its state cannot load
    assert [line for line in out.splitlines() if "error" in line] == [
        "error: cannot resume r: optim.name changed since the checkpoint (optim.name=adamw "
        "there, sgd now; that makes it a different run): set it back, or use a new "
        "run.name (the checkpoints are intact)"], out
    out = run_to_end([*args, "optim.lr=0.0123", "trainer.max_steps=4"])
    assert "resuming with changed config keys: optim.lr" in out
    for shard in (tmp_path / "r" / "checkpoints").glob("step_*/__0_0.distcp"):
        os.truncate(shard, 10)
    out = run_job(PYTHON, args, expect=2)
    assert "holds checkpoints but none is complete" in out
    assert "Traceback" not in out


def test_checkpoints_that_verify_but_do_not_fit_the_changed_config_are_never_called_bad(
        tiny_root, tmp_path):
    """SGD without momentum saves no momentum buffers; with momentum the optimizer wants
    them. The checkpoint is intact: the error names the key, and never says to remove it."""
    args = command(tiny_root, tmp_path, "model=tiny_cnn", "data.num_workers=0",
                   "trainer.max_steps=2", "checkpoint.interval_steps=1", "optim=sgd",
                   "optim.nesterov=false")
    run_to_end([*args, "optim.momentum=0"])
    out = run_job(PYTHON, args, expect=2)
    errors = [line for line in out.splitlines() if "error" in line]
    assert errors == [
        f"error: cannot resume r: 2 complete checkpoint(s) in {tmp_path}/r/checkpoints (steps 2, "
        f"1) verify but do not load into this run's state (see the warnings above); config "
        f"keys changed since they were saved: optim.momentum: set them back, or use a new "
        f"run.name (the checkpoints are intact: keep them)"], out
    assert "remove them" not in out
    assert "torch.distributed is disabled" not in out  # single-process loads on purpose
    checkpoints = Store(str(tmp_path / "r" / "checkpoints"))
    assert [step for step, _ in commit.find_complete(checkpoints)] == [2, 1]


@pytest.mark.mount
def test_commit_protocol_on_a_real_fuse_mount_killed_mid_upload(tiny_root, tmp_path, reference):
    """checkpoint.dir on a writable network mount (rclone webdav + FUSE, write cache), the
    upload from the local staging tier SIGKILLed halfway."""
    with rclone_mount(tmp_path / "served", tmp_path / "mnt", cache_mode="writes") as mnt:
        args = command(tiny_root, tmp_path, f"checkpoint.dir={mnt / 'ckpt'}",
                       f"checkpoint.staging_dir={tmp_path / 'staging'}")
        killed_run(args, fault="kill:save=3:phase=uploading")
        store = Store(str(mnt / "ckpt"))
        assert [s for s, _ in commit.find_complete(store)] == [6, 3]
        assert [n for n in os.listdir(mnt / "ckpt") if "partial" in n]  # the torn attempt
        since, committed = time.time(), complete_now(store)
        run_to_end(args)
        assert assert_resumed(tmp_path / "ledger.jsonl", since, committed) == 6
        final = checkpoint_contents(mnt / "ckpt" / FINAL)
        assert_same_contents(final, reference["contents"])
        assert not [n for n in os.listdir(mnt / "ckpt") if "partial" in n]
    # What the server holds (not just the mount's cache) is the committed checkpoint.
    assert commit.verify(Store(str(tmp_path / "served" / "ckpt")), FINAL, 12) == 1

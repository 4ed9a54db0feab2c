"""Crash and resume with real processes: SIGKILL at random steps and inside a background
save, then the same command again. The run must end bit-identical to one that was never
interrupted: model, optimizer, scheduler, data position and RNG, and the same samples."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List

import pytest
import torch
from torch.distributed.checkpoint.format_utils import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

from checkpointing import commit
from checkpointing.safe_load import SafeFileSystemReader
from checkpointing.storage import Store
from conftest import REPO, rclone_mount, tiny_overrides
from data.ledger import read_ledger

FINAL = "step_000000012"  # 2 epochs of 6 steps


def command(tiny_root: Path, run_root: Path, *extra: str) -> List[str]:
    # Dropout in the head makes training draw from the global RNG, and 2 workers decode
    # ahead of the loop: both must be handled for resume to be exact.
    return [sys.executable, "-m", "train", "+experiment=resnet", *tiny_overrides(tiny_root),
            "logger=none", "model.dropout=0.3", "data.num_workers=2",
            "checkpoint.interval_steps=3", f"audit.ledger={run_root / 'ledger.jsonl'}",
            f"run.root={run_root}", "run.name=r", *extra]


def start(args: List[str], fault: str = "") -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "GOODPUT_FAULT"}
    env["PYTHONPATH"] = str(REPO)
    if fault:
        env["GOODPUT_FAULT"] = fault
    return subprocess.Popen(args, cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def finish(proc: subprocess.Popen, timeout: float = 180) -> str:
    out, _ = proc.communicate(timeout=timeout)
    return out


def run_to_end(args: List[str], fault: str = "") -> str:
    proc = start(args, fault)
    out = finish(proc)
    assert proc.returncode == 0, out[-3000:]
    return out


def kill_after_steps(args: List[str], ledger: Path, steps: int, fault: str = "",
                     after_commit: Store | None = None) -> None:
    """SIGKILL the run from outside once its ledger has `steps` more lines (and, with
    `after_commit`, once it has committed a checkpoint, so that every life makes progress:
    a save takes longer than a few of these tiny steps)."""
    before = ledger.read_text().count("\n") if ledger.exists() else 0
    committed = set(commit.committed_steps(after_commit)) if after_commit else set()
    proc = start(args, fault)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        new_commit = not after_commit or set(commit.committed_steps(after_commit)) - committed
        if new_commit and ledger.exists() and ledger.read_text().count("\n") - before >= steps:
            proc.send_signal(signal.SIGKILL)
            break
        time.sleep(0.01)
    finish(proc)
    assert proc.returncode == -signal.SIGKILL, "the run ended before it could be killed"


def checkpoint_contents(path: Path) -> Dict[str, object]:
    """Every item of a checkpoint, flattened to dotted keys."""
    state: Dict[str, object] = {}
    _load_state_dict(state, storage_reader=SafeFileSystemReader(str(path)),
                     planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    flat: Dict[str, object] = {}

    def walk(prefix: str, node: object) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                walk(f"{prefix}{k}.", v)
        else:
            flat[prefix[:-1]] = node

    walk("", state)
    assert any(k.startswith("model.") for k in flat)
    return flat


def assert_same_contents(a: Dict[str, object], b: Dict[str, object], keys_prefix: str = ""):
    keys = sorted(k for k in a if k.startswith(keys_prefix))
    assert keys == sorted(k for k in b if k.startswith(keys_prefix))
    differ = [k for k in keys if not (torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor)
                                      else a[k] == b[k])]
    assert not differ, differ[:10]


def samples_by_step(ledger: Path) -> Dict[int, list]:
    return {step: record["samples"] for (step, _), record in read_ledger(ledger).items()}


@pytest.fixture(scope="module")
def reference(tiny_root, tmp_path_factory):
    """The uninterrupted run."""
    root = tmp_path_factory.mktemp("reference")
    run_to_end(command(tiny_root, root))
    return {"contents": checkpoint_contents(root / "r" / "checkpoints" / FINAL),
            "samples": samples_by_step(root / "ledger.jsonl")}


def assert_matches_reference(root: Path, reference: dict) -> None:
    final = checkpoint_contents(root / "r" / "checkpoints" / FINAL)
    assert_same_contents(final, reference["contents"])
    samples = samples_by_step(root / "ledger.jsonl")
    assert samples == reference["samples"]
    # Exact-once per epoch in the surviving history.
    for epoch_steps in (range(1, 7), range(7, 13)):
        seen = [i for s in epoch_steps for i in samples[s]]
        assert len(seen) == len(set(seen)) == 120


def test_repeated_kills_at_random_steps_end_bit_identical(tiny_root, tmp_path, reference):
    args = command(tiny_root, tmp_path, "checkpoint.keep_last=2")
    ledger = tmp_path / "ledger.jsonl"
    rng = random.Random(20261130)
    store = Store(str(tmp_path / "r" / "checkpoints"))
    for _ in range(3):
        kill_after_steps(args, ledger, rng.randint(1, 4), after_commit=store)
        # Retention under kills: whatever instant it died at, a complete checkpoint is left.
        assert next(commit.find_complete(store), None) is not None
    out = run_to_end(args)
    assert "resumed from" in out
    assert_matches_reference(tmp_path, reference)


@pytest.mark.parametrize("phase", ["uploading", "committing"])
def test_a_kill_inside_a_background_save_loses_nothing(tiny_root, tmp_path, reference, phase):
    args = command(tiny_root, tmp_path, f"checkpoint.staging_dir={tmp_path / 'staging'}")
    proc = start(args, fault=f"kill:checkpoint:2:{phase}")
    finish(proc)
    assert proc.returncode == -signal.SIGKILL
    store = Store(str(tmp_path / "r" / "checkpoints"))
    assert [s for s, _ in commit.find_complete(store)] == [3]  # save 2 (step 6) never landed
    out = run_to_end(args)
    assert "resumed from" in out and "(step 3," in out
    assert_matches_reference(tmp_path, reference)
    assert not [n for n in os.listdir(store.root) if "partial" in n]  # cleaned after commit


def test_process_based_async_save_resumes_exactly(tiny_root, tmp_path, reference):
    args = command(tiny_root, tmp_path, "checkpoint.async_mode=process")
    kill_after_steps(args, tmp_path / "ledger.jsonl", 2,
                     after_commit=Store(str(tmp_path / "r" / "checkpoints")))
    run_to_end(args)
    assert_matches_reference(tmp_path, reference)


@pytest.mark.parametrize("omitted, what_differs", [
    ("rng", "model."),  # dropout masks come from the RNG: the weights drift
    ("data", "samples"),  # the sampler restarts its epoch: other samples
])
def test_negative_controls_leaving_state_out_breaks_equivalence(tiny_root, tmp_path, reference,
                                                               omitted, what_differs):
    args = command(tiny_root, tmp_path)
    kill_after_steps(args, tmp_path / "ledger.jsonl", 2, fault=f"omit:{omitted}",
                     after_commit=Store(str(tmp_path / "r" / "checkpoints")))
    run_to_end(args, fault=f"omit:{omitted}")
    if what_differs == "samples":
        assert samples_by_step(tmp_path / "ledger.jsonl") != reference["samples"]
    else:
        final = checkpoint_contents(tmp_path / "r" / "checkpoints" / FINAL)
        with pytest.raises(AssertionError):
            assert_same_contents(final, reference["contents"], what_differs)


def test_resume_modes_and_no_valid_checkpoint_are_clear_errors(tiny_root, tmp_path):
    args = command(tiny_root, tmp_path, "trainer.max_steps=3")
    proc = start([*args, "checkpoint.resume=required"])
    out = finish(proc)
    assert proc.returncode == 2 and "checkpoint.resume=required" in out
    run_to_end(args)
    proc = start([*args, "checkpoint.resume=never"])
    out = finish(proc)
    assert proc.returncode == 2 and "checkpoint.resume=never" in out
    proc = start([*args, "model.name=resnet34"])
    out = finish(proc)
    assert proc.returncode == 2 and "model.name changed since the checkpoint" in out
    out = run_to_end([*args, "optim.lr=0.0123", "trainer.max_steps=4"])
    assert "resuming with changed config keys: optim.lr" in out
    for shard in (tmp_path / "r" / "checkpoints").glob("step_*/__0_0.distcp"):
        os.truncate(shard, 10)
    proc = start(args)
    out = finish(proc)
    assert proc.returncode == 2, out[-2000:]
    assert "holds checkpoints but none is complete" in out
    assert "Traceback" not in out


def test_commit_protocol_on_a_real_fuse_mount_killed_mid_upload(tiny_root, tmp_path, reference):
    """checkpoint.dir on a writable network mount (rclone webdav + FUSE, write cache), the
    upload from the local staging tier SIGKILLed halfway."""
    with rclone_mount(tmp_path / "served", tmp_path / "mnt", cache_mode="writes") as mnt:
        args = command(tiny_root, tmp_path, f"checkpoint.dir={mnt / 'ckpt'}",
                       f"checkpoint.staging_dir={tmp_path / 'staging'}")
        proc = start(args, fault="kill:checkpoint:3:uploading")
        finish(proc)
        assert proc.returncode == -signal.SIGKILL
        store = Store(str(mnt / "ckpt"))
        assert [s for s, _ in commit.find_complete(store)] == [6, 3]
        assert [n for n in os.listdir(mnt / "ckpt") if "partial" in n]  # the torn attempt
        out = run_to_end(args)
        assert "(step 6," in out
        final = checkpoint_contents(mnt / "ckpt" / FINAL)
        assert_same_contents(final, reference["contents"])
        assert not [n for n in os.listdir(mnt / "ckpt") if "partial" in n]
    # What the server holds (not just the mount's cache) is the committed checkpoint.
    assert commit.verify(Store(str(tmp_path / "served" / "ckpt")), FINAL, 12) == 1

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
from typing import List

import pytest
import torch
from torch.distributed.checkpoint._nested_dict import flatten_state_dict

from checkpointing import commit, verify
from checkpointing.safe_load import load_metadata
from checkpointing.storage import Store
from checkpointing.writer import RAW
from support.checkpoints import (assert_matches_reference, assert_same_contents,
                                 checkpoint_contents, complete_now, flattened, reference_of)
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
def reference_root(tiny_root, tmp_path_factory) -> Path:
    """The uninterrupted run, made once however many xdist workers run these tests."""
    return made_once(tmp_path_factory, "reference_resume",
                     lambda root: run_to_end(command(tiny_root, root)))


@pytest.fixture(scope="module")
def reference(reference_root):
    return reference_of(reference_root)


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


# What a user of stock PyTorch runs on a checkpoint, knowing only that it is a torchvision
# ResNet-18 trained with AdamW: `dcp.load` with the default reader into a freshly built state
# dict (the model's and optimizer's from torch's own `get_state_dict`, every other entry as
# the checkpoint lists it), a model and optimizer (its parameter groups as saved) loaded from
# it, and `dcp_to_torch_save`.
STOCK_READER = """
import sys
import torch
import torch.distributed.checkpoint as dcp
import torchvision
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

checkpoint, out = sys.argv[1:]
listing = dcp.FileSystemReader(checkpoint).read_metadata().state_dict_metadata
model = torchvision.models.get_model("resnet18",
                                     num_classes=listing["model.fc.weight"].size[0])
model_state, optim_state = get_state_dict(model, torch.optim.AdamW(model.parameters()))
state = {"model": model_state, "optim": {"state": optim_state["state"]}}
for key, entry in listing.items():
    if not key.startswith(("model.", "optim.state.")):
        state[key] = (torch.empty(entry.size, dtype=entry.properties.dtype)
                      if isinstance(entry, TensorStorageMetadata) else None)
dcp.load(state, checkpoint_id=checkpoint)
torch.save(state, out + ".state.pt")
groups = {}
for key, value in state.items():
    if key.startswith("optim.param_groups."):
        index, name = key.split(".", 3)[2:]
        groups.setdefault(int(index), {})[name] = value
groups = [groups[i] for i in sorted(groups)]
named = dict(model.named_parameters())
optimizer = torch.optim.AdamW([{"params": [named[n] for n in g["params"]]} for g in groups])
set_state_dict(model, optimizer, model_state_dict=state["model"],
               optim_state_dict={"state": state["optim"]["state"], "param_groups": groups})
dcp_to_torch_save(checkpoint, out + ".whole.pt")
ours = [m for m in sys.modules if m.split(".")[0] in ("checkpointing", "train", "data", "common")]
assert not ours, f"imported modules of the trainer: {ours}"
torch.save({"model": model.state_dict(),
            "exp_avg": {n: optimizer.state[p]["exp_avg"] for n, p in named.items()},
            "weight_decay": [group["weight_decay"] for group in optimizer.param_groups]}, out)
"""


def test_a_checkpoint_is_read_by_stock_torch_alone(reference_root, tmp_path):
    """The whole state (model, optimizer, scheduler, RNG, run info, data position) of a
    trainer's checkpoint comes back through stock `dcp.load` and `dcp_to_torch_save`, in a
    fresh interpreter elsewhere that imports nothing of this project, equal to what the
    trainer's own reader reads."""
    final = reference_root / "r" / "checkpoints" / FINAL
    out = tmp_path / "read.pt"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, "-I", "-c", STOCK_READER, str(final), str(out)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ours = checkpoint_contents(final)
    assert {k.partition(".")[0] for k in ours} >= {
        "model", "optim", "scheduler", "rng", "run", "trainer", "data"}
    # what dcp.load filled = the whole state dcp_to_torch_save wrote = what our reader reads
    whole = torch.load(f"{out}.whole.pt", weights_only=False)
    assert_same_contents(flatten_state_dict(torch.load(f"{out}.state.pt",
                                                       weights_only=False))[0],
                         flatten_state_dict(whole)[0])
    assert_same_contents(flattened(whole), ours)
    live = torch.load(out, weights_only=False)
    assert_same_contents({f"model.{k}": v for k, v in live["model"].items()}, ours, "model.")
    assert_same_contents({f"optim.state.{k}.exp_avg": v for k, v in live["exp_avg"].items()},
                         {k: v for k, v in ours.items() if k.endswith(".exp_avg")})
    assert live["weight_decay"] == [g["weight_decay"] for g in ours["optim.param_groups"]]


def test_a_run_in_the_raw_format_verifies_and_resumes_under_the_default(tiny_root, tmp_path,
                                                                        reference):
    """Checkpoints of the raw format (the default before DCP's standard one, now
    `checkpoint.format=raw`) verify, and the run resumes from them with today's default and
    ends bit-identical to the uninterrupted run."""
    store = Store(str(tmp_path / "r" / "checkpoints"))
    kill_after_steps(command(tiny_root, tmp_path, "checkpoint.format=raw"),
                     tmp_path / "ledger.jsonl", 2, after_commit=store)
    raw = [step for step, _ in commit.find_complete(store)]
    for step in raw:
        with open(Path(store.path(commit.step_dir_name(step), ".metadata")), "rb") as f:
            records = load_metadata(f).storage_data.values()
        assert any(tuple(r.transform_descriptors or ()) == (RAW,) for r in records), step
    assert raw and verify.main([store.root]) == 0
    since, committed = time.time(), complete_now(store)
    run_to_end(command(tiny_root, tmp_path))
    assert assert_resumed(tmp_path / "ledger.jsonl", since, committed) in raw
    assert_matches_reference(tmp_path, reference)

"""`python -m checkpointing.verify` and `python -m checkpointing.export`.

Most tests work on checkpoints written in-process by CheckpointManager around a torchvision
ResNet-18 (the same Stateful objects the trainer saves), so they do not depend on the
training loop; one test exports the checkpoint of a real `python -m train` run.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import pickle
import re
import shutil
from pathlib import Path
from typing import Dict

import pytest
import torch
import torch.nn.functional as F
import torchvision
from safetensors.torch import load_file

from checkpointing import commit, export, verify
from checkpointing.claims import SCHEMA_KEY, ClaimMismatch, check_model, schema_of_state
from checkpointing.manager import CheckpointManager, CheckpointOptions
from checkpointing.safe_load import load_metadata
from checkpointing.storage import Store
from support.checkpoints import flip_byte
from support.launch import PYTHON, run, run_train
from support.runs import tiny_overrides
from support.tiny_job import Payload, rewrite_marker
from train.resume.stateful import ModelState, OptimizerState, RNGState

STEP_2, STEP_4 = "step_000000002", "step_000000004"


def logits(weights: Dict[str, torch.Tensor]) -> torch.Tensor:
    """The model's output on a fixed batch, through the public torchvision constructor."""
    model = torchvision.models.get_model("resnet18", num_classes=10)
    model.load_state_dict(weights, strict=True)
    model.eval()
    with torch.no_grad():
        return model(torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(7)))


def read_export(path: Path) -> Dict[str, torch.Tensor]:
    if path.suffix == ".safetensors":
        return load_file(path)
    return torch.load(path, weights_only=True)


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory):
    """A checkpoint.dir with steps 2 and 4 of a short training, and the model at each."""
    root = tmp_path_factory.mktemp("ckpt") / "checkpoints"
    torch.manual_seed(0)
    model = torchvision.models.get_model("resnet18", num_classes=10)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    # Non-tensor items (progress, RNG) make the checkpoint hold more than the model.
    state = {"model": ModelState(model), "optim": OptimizerState(model, optimizer),
             "trainer": {"step": 0}, "rng": RNGState(0)}
    manager = CheckpointManager(CheckpointOptions(dir=str(root), async_mode="thread"))
    weights = {}
    for step in range(1, 5):
        loss = F.cross_entropy(model(torch.randn(8, 3, 32, 32)), torch.randint(0, 10, (8,)))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        state["trainer"]["step"] = step
        if step % 2 == 0:
            manager.save(step, state)
            weights[step] = {k: v.clone() for k, v in model.state_dict().items()}
    manager.close()
    return root, weights


@pytest.fixture
def ckpt_dir(trained, tmp_path: Path) -> Path:
    """A private copy of the trained checkpoint.dir, for tests that damage it."""
    return Path(shutil.copytree(trained[0], tmp_path / "checkpoints"))


@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_export_reproduces_the_models_logits(trained, tmp_path, suffix):
    root, weights = trained
    out = tmp_path / f"model{suffix}"
    assert export.main([str(root), str(out)]) == 0
    exported = read_export(out)
    assert exported.keys() == torchvision.models.get_model("resnet18").state_dict().keys()
    assert torch.equal(logits(exported), logits(weights[4]))
    # The control: the older step is another model, so the comparison can tell them apart.
    older = tmp_path / f"older{suffix}"
    assert export.main([str(root / STEP_2), str(older)]) == 0
    assert torch.equal(logits(read_export(older)), logits(weights[2]))
    assert not torch.equal(logits(weights[2]), logits(weights[4]))


def test_verify_reports_each_checkpoint_and_finds_a_flipped_byte(ckpt_dir, capsys):
    (ckpt_dir / ".step_000000006.partial-1-abc").mkdir()
    assert verify.main([str(ckpt_dir)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == ".step_000000006.partial-1-abc  partial (ignored)"
    assert [line.split()[:2] for line in lines[1:]] == [[STEP_4, "complete"],
                                                         [STEP_2, "complete"]]
    assert re.fullmatch(r"step_000000004  complete  \(2 files, \d+\.\d MB, world size 1\)",
                        lines[1])

    flip_byte(ckpt_dir / STEP_4 / "__0_0.distcp")
    assert verify.main([str(ckpt_dir)]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[1] == (f"{STEP_4}  INCOMPLETE: __0_0.distcp does not match its checksum "
                        f"(altered or swapped)")
    assert lines[2].startswith(f"{STEP_2}  complete")


def test_verify_of_a_missing_directory_is_a_one_line_error(tmp_path):
    result = run(PYTHON, ["-m", "checkpointing.verify", str(tmp_path / "nowhere")])
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [f"error: {tmp_path / 'nowhere'} is not a "
                                                  f"directory"]


def test_export_refuses_a_damaged_checkpoint(ckpt_dir, tmp_path):
    flip_byte(ckpt_dir / STEP_4 / "__0_0.distcp")
    out = tmp_path / "model.pt"
    result = run(PYTHON, ["-m", "checkpointing.export", str(ckpt_dir / STEP_4), str(out)])
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"error: {ckpt_dir / STEP_4} is incomplete: __0_0.distcp does not match its checksum "
        f"(altered or swapped)"]
    assert not out.exists()


def test_export_never_runs_a_planted_metadata_pickle(ckpt_dir, tmp_path, capsys):
    side_effect = tmp_path / "pwned"
    metadata = ckpt_dir / STEP_4 / ".metadata"
    metadata.write_bytes(pickle.dumps(Payload(side_effect)))
    # Re-sign the marker, as an attacker with write access would: checksums alone pass.
    marker = ckpt_dir / STEP_4 / "commit_rank_0.json"
    body = json.loads(marker.read_text())
    body["files"][".metadata"] = {"size": metadata.stat().st_size,
                                  "sha256": hashlib.sha256(metadata.read_bytes()).hexdigest()}
    marker.write_text(json.dumps(body))

    assert export.main([str(ckpt_dir / STEP_4), str(tmp_path / "model.pt")]) == 2
    error = capsys.readouterr().err.strip()
    assert error.startswith("error: ") and ".metadata is unsafe" in error, error
    assert not side_effect.exists()
    # The control: the same pickle does run when loaded the way DCP does by default.
    pickle.loads(metadata.read_bytes())
    assert side_effect.exists()


def test_export_picks_the_newest_complete_step_not_names_or_times(trained, ckpt_dir, tmp_path,
                                                                 capsys):
    weights = trained[1]
    # step 9: the highest step and the last name, a copy of step 2 that claims to be step 9.
    step_9 = Path(shutil.copytree(ckpt_dir / STEP_2, ckpt_dir / "step_000000009"))
    marker = step_9 / "commit_rank_0.json"
    marker.write_text(json.dumps(dict(json.loads(marker.read_text()), step=9)))
    # ... and step 2 the newest by file times.
    for age, name in [(300, STEP_4), (200, "step_000000009"), (100, STEP_2)]:
        for path in [ckpt_dir / name, *(ckpt_dir / name).iterdir()]:
            os.utime(path, (path.stat().st_atime, path.stat().st_mtime + 1000 - age))

    out = tmp_path / "model.pt"
    # The control: while intact, step 9 is a complete checkpoint and is picked; it records
    # step 2 inside, so it is refused rather than exported as step 9.
    assert export.main([str(ckpt_dir), str(out)]) == 2
    assert "checkpoint step_000000009 records step 2" in capsys.readouterr().err

    flip_byte(step_9 / "__0_0.distcp")
    assert export.main([str(ckpt_dir), str(out)]) == 0
    assert torch.equal(logits(read_export(out)), logits(weights[4]))


def test_export_of_a_training_run_loads_into_torchvision(tmp_path, tiny_root):
    result = run_train(["+experiment=resnet", *tiny_overrides(tiny_root), "logger=none",
                        "trainer.max_steps=4", "checkpoint.interval_steps=2",
                        f"run.root={tmp_path}", "run.name=r"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    # One process saves without a process group on purpose: DCP's warning about it is noise
    assert "torch.distributed is disabled" not in result.stdout + result.stderr
    final = torch.load(tmp_path / "r" / "model_final.pt", weights_only=True)
    out = tmp_path / "model.safetensors"
    assert export.main([str(tmp_path / "r" / "checkpoints"), str(out)]) == 0
    assert torch.equal(logits(load_file(out)), logits(final))


@pytest.mark.parametrize("card", ["{not json", "[" * 100_000, 12, "[1, 2]", '"x"', None])
def test_a_model_card_that_is_not_a_json_object_is_refused_in_one_line(tmp_path, capsys,
                                                                       card):
    root = tmp_path / "checkpoints"
    model = torchvision.models.get_model("resnet18", num_classes=10)
    manager = CheckpointManager(CheckpointOptions(dir=str(root), async_mode="off"))
    manager.save(1, {"model": ModelState(model), "run": {"config": {"model_card": card}}})
    manager.close()
    assert export.main([str(root), str(tmp_path / "out.pt")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "model card" in err and err.count("\n") == 1
    assert not (tmp_path / "out.pt").exists()


def carded_checkpoints(root: Path) -> int:
    """Steps 15 and 20 of a small model, each with the model card the trainer records (its
    tensors included) and the trainer's step; the number of model tensors."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4),
                                torch.nn.Flatten(), torch.nn.LazyLinear(2))
    model(torch.zeros(1, 3, 6, 6))
    card = {"model": "small", "num_classes": 2, SCHEMA_KEY: schema_of_state(model.state_dict())}
    manager = CheckpointManager(CheckpointOptions(dir=str(root), async_mode="off"))
    for step in (15, 20):
        with torch.no_grad():
            model[0].weight.add_(1.0)
        manager.save(step, {"model": ModelState(model), "trainer": {"step": step},
                            "run": {"config": {"model_card": json.dumps(card)}}})
    manager.close()
    return len(model.state_dict())


def drop_two_model_keys(root: Path) -> None:
    def forge(metadata) -> None:
        for key in ("model.0.bias", "model.3.bias"):
            del metadata.state_dict_metadata[key]
    forge_metadata(root / STEP_20, forge)


def make_a_weight_int32(root: Path) -> None:
    def forge(metadata) -> None:
        metadata.state_dict_metadata["model.0.weight"].properties.dtype = torch.int32
    forge_metadata(root / STEP_20, forge)


def rename_a_weight(root: Path) -> None:
    def forge(metadata) -> None:
        old, new = "model.0.weight", "model.0.renamed"
        metadata.state_dict_metadata[new] = metadata.state_dict_metadata.pop(old)
        metadata.storage_data = {(dataclasses.replace(k, fqn=new) if k.fqn == old else k): v
                                 for k, v in metadata.storage_data.items()}
    forge_metadata(root / STEP_20, forge)


def put_step_15_in_step_20(root: Path) -> None:
    shutil.rmtree(root / STEP_20)
    shutil.copytree(root / "step_000000015", root / STEP_20)
    (root / STEP_20 / "commit_rank_0.json").unlink()
    rewrite_marker(root / STEP_20)


def forge_metadata(step_dir: Path, forge) -> None:
    """`.metadata` changed by `forge`, and the marker re-signed, as an attacker would."""
    metadata = load_metadata(io.BytesIO((step_dir / ".metadata").read_bytes()))
    forge(metadata)
    (step_dir / ".metadata").write_bytes(pickle.dumps(metadata))
    rewrite_marker(step_dir)


STEP_20 = "step_000000020"


@pytest.mark.parametrize("tamper, error", [
    (drop_two_model_keys, "holds {n2} model tensors where its model card records {n}: it "
                          "is not the model it was saved as"),
    (rename_a_weight, "holds {n} model tensors as its model card records, but other "
                      "names, shapes or dtypes: it is not the model it was saved as"),
    # In DCP's standard format each record says its dtype: the reader refuses it first.
    (make_a_weight_int32, "failed: UnsafeCheckpointError: model.0.weight: its record holds a "
                          "torch.float32 tensor of shape [4, 3, 3, 3], .metadata a torch.int32 "
                          "chunk of shape [4, 3, 3, 3]"),
    (put_step_15_in_step_20, "records step 15: it was not written by this trainer at step "
                             "20"),
])
def test_export_refuses_what_resume_refuses(tmp_path, capsys, tamper, error):
    """Markers re-signed over other contents: only what the checkpoint claims to be gives
    it away, the same claims resume checks."""
    root = tmp_path / "checkpoints"
    n = carded_checkpoints(root)
    out = tmp_path / "model.pt"
    assert export.main([str(root), str(out)]) == 0  # the control: intact, it exports
    out.unlink()
    tamper(root)
    assert [s for s, _ in commit.find_complete(Store(str(root)))] == [20, 15]  # checksums pass
    assert export.main([str(root), str(out)]) == 2
    err = capsys.readouterr().err
    said = f"loading {root / STEP_20}" if error.startswith("failed") else f"checkpoint {STEP_20}"
    assert err.splitlines() == [f"error: {said} " + error.format(n=n, n2=n - 2)]
    assert not out.exists()


@pytest.mark.parametrize("forged", ["x" * 10**6, {"count": "9" * 10**6}, {"count": [1] * 10**5},
                                    {"count": None, "sha256": 5}, [], 0])
def test_a_forged_tensor_record_of_any_type_is_one_short_line(forged) -> None:
    """The model card's `tensors` record is read from the checkpoint: whatever its type or
    size, a mismatch is one short line, never a traceback or a megabyte of message."""
    schema = schema_of_state({"w": torch.zeros(2)})
    with pytest.raises(ClaimMismatch) as refused:
        check_model("step_000000004", {SCHEMA_KEY: forged}, schema)
    line = str(refused.value)
    assert "\n" not in line and len(line) < 300, line[:400]

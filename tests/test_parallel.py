"""strategy=ddp|fsdp under torchrun (gloo, CPU) against one process at the same global batch.

Parity runs use `tiny_cnn_nobn`: BatchNorm statistics are per rank on CPU
(docs/architecture.md, pitfalls), so only a model without them follows the same trajectory
at every world size. Runs are shared through module-scoped fixtures; each is a real
`python -m train` (or torchrun) process.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Dict, List

import pytest
import torch

from checkpointing.export import load_model_state
from support.launch import PYTHON, run, torchrun
from support.runs import tiny_overrides
from train.config import ModelConfig
from train.learn.model import build_model

TOL = dict(rtol=1e-5, atol=1e-5)
STEP_4 = "checkpoints/step_000000004"


def train(nproc: int, root: Path, data: Path, name: str, *overrides: str,
          check: bool = True) -> subprocess.CompletedProcess:
    """A run `name` under `root`: one process when nproc is 0, else torchrun with nproc."""
    done = run(torchrun(nproc) if nproc else PYTHON,
               ["-m", "train", *tiny_overrides(data), "logger=none", "trainer.device=cpu",
                f"run.root={root}", f"run.name={name}", *overrides])
    if check:
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


def weights(path: Path) -> Dict[str, torch.Tensor]:
    return (load_model_state(path) if path.is_dir()
            else torch.load(path, weights_only=True))


def max_diff(a: Dict[str, torch.Tensor], b: Dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def assert_close(a: Dict[str, torch.Tensor], b: Dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], **TOL, msg=lambda m: f"{key}: {m}")


NOBN = ["model=tiny_cnn_nobn"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("parallel")


@pytest.fixture(scope="module")
def single(runs: Path, tiny_root: Path) -> Path:
    """The reference: one process, 6 steps, checkpoints at 2, 4 and 6."""
    train(0, runs, tiny_root, "single", *NOBN, "trainer.max_steps=6",
          "checkpoint.interval_steps=2")
    return runs / "single"


@pytest.fixture(scope="module")
def fsdp(runs: Path, tiny_root: Path) -> Path:
    # Two micro-batches per rank: only the second backward reduce-scatters, carrying both.
    train(2, runs, tiny_root, "fsdp", *NOBN, "strategy=fsdp", "trainer.grad_accum_steps=2",
          "trainer.max_steps=4")
    return runs / "fsdp"


def test_ddp_with_accumulation_matches_one_process(single, runs, tiny_root):
    # Two micro-batches per rank: the first backward runs under no_sync, the second
    # all-reduces the sum of both.
    train(2, runs, tiny_root, "ddp", *NOBN, "strategy=ddp", "trainer.grad_accum_steps=2",
          "trainer.max_steps=4")
    final = weights(runs / "ddp" / "model_final.pt")
    assert_close(final, weights(single / STEP_4))
    # The checkpoint holds the model's own names, not DDP's `module.` ones.
    assert_close(weights(runs / "ddp" / STEP_4), final)


def test_fsdp_averages_gradients_like_one_process(single, fsdp, runs, tiny_root):
    reference = weights(single / STEP_4)
    final = weights(fsdp / "model_final.pt")
    print(f"FSDP W=2 vs one process after 4 steps: max |diff| = {max_diff(final, reference):.2e}")
    assert_close(final, reference)
    # pytorch#162338: a backend that sums instead of averaging doubles every gradient. For
    # SGD that is exactly lr x2 with weight decay /2, which one process can run: FSDP's
    # weights must be far from that run's, and that run far from the reference.
    train(0, runs, tiny_root, "summed", *NOBN, "optim.lr=0.2", "optim.weight_decay=2.5e-4",
          "trainer.max_steps=4")
    summed = weights(runs / "summed" / "model_final.pt")
    assert max_diff(summed, reference) > 1000 * TOL["atol"]
    assert max_diff(final, summed) > 1000 * TOL["atol"]


def test_an_fsdp_checkpoint_resumes_in_one_process(single, fsdp, tmp_path, tiny_root):
    shutil.copytree(fsdp, tmp_path / "fsdp")
    done = train(0, tmp_path, tiny_root, "fsdp", *NOBN, "trainer.max_steps=6")
    assert "(step 4, saved at world size 2)" in done.stdout + done.stderr
    # Saved sharded at W=2, loaded whole at W=1 and trained on: still the reference's path.
    assert_close(weights(tmp_path / "fsdp" / "model_final.pt"),
                 weights(single / "model_final.pt"))


def test_a_one_process_checkpoint_resumes_under_fsdp_with_batchnorm(runs, tiny_root):
    train(0, runs, tiny_root, "bn", "model=tiny_cnn", "trainer.max_steps=2")
    done = train(2, runs, tiny_root, "bn", "model=tiny_cnn", "strategy=fsdp",
                 "trainer.max_steps=4")
    assert "(step 2, saved at world size 1)" in done.stdout + done.stderr
    final = weights(runs / "bn" / "model_final.pt")
    exported = weights(runs / "bn" / STEP_4)
    stock = build_model(ModelConfig(name="tiny_cnn"), 10).state_dict()
    assert exported.keys() == final.keys() == stock.keys()
    build_model(ModelConfig(name="tiny_cnn"), 10).load_state_dict(exported, strict=True)
    # Ranks' BatchNorm statistics differ; the checkpoint must hold rank 0's (broadcast before
    # staging), which is also what rank 0 writes as the final weights.
    buffers = [k for k in final if "running_" in k]
    assert buffers
    for key in buffers:
        assert torch.equal(exported[key], final[key]), key


def test_strategy_single_refuses_several_ranks(runs, tiny_root):
    done = train(2, runs, tiny_root, "refused", *NOBN, "trainer.max_steps=1", check=False)
    assert done.returncode != 0
    lines: List[str] = [line for line in done.stderr.splitlines()
                        if "use strategy=ddp or strategy=fsdp" in line]
    assert lines and all(line.startswith("error: strategy=single") for line in lines), \
        done.stderr[-3000:]

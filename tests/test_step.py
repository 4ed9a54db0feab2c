"""The training step's settings and its per-step extras: the gradient-norm pass and the
determinism switch (what they cost: benchmarks/train_throughput.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from train.app import seed_everything
from train.loop import gradient_norm
from train.learn.model import TinyCNN


def model_with_gradients() -> torch.nn.Module:
    torch.manual_seed(0)
    model = TinyCNN(10)
    F.cross_entropy(model(torch.randn(4, 3, 16, 16)), torch.arange(4)).backward()
    return model


def test_without_a_limit_the_norm_is_measured_and_no_gradient_is_rewritten():
    model = model_with_gradients()
    versions = [p.grad._version for p in model.parameters()]
    expected = torch.linalg.vector_norm(
        torch.cat([p.grad.flatten() for p in model.parameters()]))
    norm = gradient_norm(model, None)
    assert torch.allclose(norm, expected)
    # clip_grad_norm_(inf) would multiply every gradient by 1.0: a pass over all of them
    assert [p.grad._version for p in model.parameters()] == versions


def test_a_limit_still_clips_and_returns_the_norm_before_clipping():
    model = model_with_gradients()
    before = gradient_norm(model, None)
    assert gradient_norm(model, float(before) / 2) == before
    assert torch.allclose(gradient_norm(model, None), before / 2, rtol=1e-4)


@pytest.fixture
def restore_determinism():
    saved = (torch.are_deterministic_algorithms_enabled(),
             torch.utils.deterministic.fill_uninitialized_memory)
    yield
    torch.use_deterministic_algorithms(saved[0])
    torch.utils.deterministic.fill_uninitialized_memory = saved[1]


@pytest.mark.usefixtures("restore_determinism")
@pytest.mark.parametrize("deterministic", [True, False])
def test_the_determinism_switch_on_cpu(deterministic):
    seed_everything(0, torch.device("cpu"), deterministic)
    assert torch.are_deterministic_algorithms_enabled() == deterministic
    # The NaN fill of every new tensor was the measured cost; no kernel of ours needs it.
    assert not torch.utils.deterministic.fill_uninitialized_memory

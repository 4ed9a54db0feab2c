"""The model and optimizer state a checkpoint saves: DCP's own answer, or a shortcut that
matched it exactly (DCP's adapters cost tens of milliseconds a save while the loop waits)."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.checkpoint.state_dict import (get_model_state_dict,
                                                     get_optimizer_state_dict)
from torch.nn.parallel import DistributedDataParallel

import train.resume.stateful as state_module
from support.worlds import one_rank_world  # noqa: F401  (a fixture)
from train.resume.stateful import ModelState, OptimizerState, _CheckedShortcut, _same


def trained(model: torch.nn.Module) -> torch.optim.Optimizer:
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.randn(4, 8)).sum().backward()
    optimizer.step()
    return optimizer


def tiny() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8),
                               torch.nn.Linear(8, 2))


class Calls:
    """Counts the calls of DCP's adapters as train.resume.stateful makes them."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.count = 0
        for name in ("get_model_state_dict", "get_optimizer_state_dict"):
            original = getattr(state_module, name)

            def counted(*args, _original=original, **kwargs):
                self.count += 1
                return _original(*args, **kwargs)
            monkeypatch.setattr(state_module, name, counted)


@pytest.mark.parametrize("wrap", ["plain", "ddp"])
def test_the_shortcut_gives_dcp_s_answer_and_is_taken(monkeypatch, request, wrap):
    model = tiny()
    if wrap == "ddp":
        request.getfixturevalue("one_rank_world")
        model = DistributedDataParallel(model)
    optimizer = trained(model)
    calls = Calls(monkeypatch)
    states = [ModelState(model), OptimizerState(model, optimizer)]
    first = [s.state_dict() for s in states]
    assert calls.count == 2  # the first save asks DCP, and checks the shortcut against it
    trained_more = optimizer.step  # the values move; names and tensors stay
    model(torch.randn(4, 8)).sum().backward()
    trained_more()
    again = [s.state_dict() for s in states]
    assert calls.count == 2  # the shortcut, both times
    expected = [get_model_state_dict(model), get_optimizer_state_dict(model, optimizer)]
    assert all(_same(a, e) for a, e in zip(again, expected))
    assert all(_same(a, f) for a, f in zip(again, first))
    assert not any(k.startswith("module.") for k in again[0])


def test_new_parameters_go_back_to_dcp(monkeypatch):
    model = tiny()
    optimizer = trained(model)
    states = [ModelState(model), OptimizerState(model, optimizer)]
    [s.state_dict() for s in states]
    calls = Calls(monkeypatch)
    model.append(torch.nn.Linear(2, 3))  # a new head, trained too
    optimizer.add_param_group({"params": model[3].parameters()})
    model(torch.randn(4, 8)).sum().backward()
    optimizer.step()
    got = [s.state_dict() for s in states]
    assert calls.count == 2
    assert _same(got[0], get_model_state_dict(model))
    assert _same(got[1], get_optimizer_state_dict(model, optimizer))
    assert got[0]["3.weight"].shape == (3, 2) and "3.weight" in got[1]["state"]


def test_a_shortcut_that_differs_from_dcp_is_never_used():
    shortcut = _CheckedShortcut(tiny())
    answers = iter(range(10))

    def dcp():
        return {"a": next(answers)}
    assert shortcut.get(lambda: {"a": -1}, dcp, lambda: [1]) == {"a": 0}
    assert shortcut.get(lambda: {"a": -1}, dcp, lambda: [1]) == {"a": 1}
    assert not shortcut.usable

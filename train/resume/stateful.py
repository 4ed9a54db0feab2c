"""What a checkpoint holds, as `Stateful` objects (`state_dict()` / `load_state_dict()`).

Everything here saves tensors or plain data (numbers, strings, lists, dicts), so a
checkpoint loads with `weights_only=True` and never needs to unpickle code.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass
from typing import Any, Callable, Dict, List, Optional

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel
from torch.distributed.checkpoint.state_dict import (get_model_state_dict,
                                                     get_optimizer_state_dict,
                                                     set_model_state_dict,
                                                     set_optimizer_state_dict)

from data.sampler import derive_seed
from train.errors import ConfigError


def _unwrapped(model: torch.nn.Module) -> torch.nn.Module:
    """The module under DDP's and torch.compile's wrappers, whose names DCP's state dicts use."""
    while isinstance(model, DistributedDataParallel) or hasattr(model, "_orig_mod"):
        model = model.module if isinstance(model, DistributedDataParallel) else model._orig_mod
    return model


def _same(a: Any, b: Any) -> bool:
    """The same structure, holding the same tensors (storage, shape, dtype) and values."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (type(a) is type(b) and a.data_ptr() == b.data_ptr() and a.shape == b.shape
                and a.dtype == b.dtype and a.stride() == b.stride())
    return type(a) is type(b) and a == b


class _CheckedShortcut:
    """DCP's `get_model_state_dict` / `get_optimizer_state_dict` walk every module and
    parameter to name them, each call: 30-80 ms for ResNet-50 + AdamW on 2 CPU cores, as much
    as staging's copy, while the loop is blocked. Without FSDP the names are the unwrapped
    module's own, so the plain `state_dict()` renamed is the same thing: `get` takes the
    shortcut once it has matched DCP's answer exactly (same names, same tensors, same values)
    and while the parameters are the ones it matched, else asks DCP."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.params: Optional[List[int]] = None  # ids of the parameters matched; None: unchecked
        self.usable = True  # False once the shortcut differed from DCP: DCP from then on

    def get(self, shortcut: Callable[[], Dict[str, Any]],
            dcp: Callable[[], Dict[str, Any]], params: Callable[[], List[int]]
            ) -> Dict[str, Any]:
        if self.usable and self.params is not None and params() == self.params:
            return shortcut()
        result = dcp()
        if self.usable and not any(isinstance(p, DTensor) for p in self.model.parameters()):
            self.usable = _same(shortcut(), result)
            self.params = params()
        return result


class ModelState:
    """Parameters and buffers (BatchNorm statistics included), valid for single/DDP/FSDP.

    With a `sync_group`, replicated buffers are broadcast from rank 0 right before they are
    staged: between forwards, ranks' BatchNorm statistics differ, and DCP may write any
    rank's copy of a replicated tensor (it spreads the writes), so an unsynced checkpoint
    would mix ranks' statistics.
    """

    def __init__(self, model: torch.nn.Module,
                 sync_group: Optional[dist.ProcessGroup] = None) -> None:
        self.model, self.sync_group = model, sync_group
        self._shortcut = _CheckedShortcut(model)

    def state_dict(self) -> Dict[str, Any]:
        if self.sync_group is not None and dist.get_world_size(self.sync_group) > 1:
            for buffer in self.model.buffers():
                dist.broadcast(buffer, src=dist.get_global_rank(self.sync_group, 0),
                               group=self.sync_group)
        return self._shortcut.get(lambda: dict(_unwrapped(self.model).state_dict()),
                                  lambda: get_model_state_dict(self.model),
                                  lambda: [id(t) for t in self.model.state_dict(keep_vars=True)
                                           .values()])

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        set_model_state_dict(self.model, state)


class OptimizerState:
    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model, self.optimizer = model, optimizer
        self._shortcut = _CheckedShortcut(model)

    def state_dict(self) -> Dict[str, Any]:
        return self._shortcut.get(self._named, lambda: get_optimizer_state_dict(
            self.model, self.optimizer), self._param_ids)

    def _param_ids(self) -> List[int]:
        return [id(p) for group in self.optimizer.param_groups for p in group["params"]]

    def _named(self) -> Dict[str, Any]:
        """`optimizer.state_dict()` with each parameter's index replaced by its name."""
        name_of = {id(p): n for n, p in _unwrapped(self.model).named_parameters()}
        names = [name_of.get(i) for i in self._param_ids()]
        plain = self.optimizer.state_dict()
        return {"state": {names[i]: dict(s) for i, s in plain["state"].items()},
                "param_groups": [{**g, "params": [names[i] for i in g["params"]]}
                                 for g in plain["param_groups"]]}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        set_optimizer_state_dict(self.model, self.optimizer, state)


class SchedulerState:
    """Only the counters: the schedule itself is rebuilt from the config, and the current
    learning rates come back with the optimizer's param groups."""

    def __init__(self, scheduler: torch.optim.lr_scheduler.LRScheduler) -> None:
        self.scheduler = scheduler

    def state_dict(self) -> Dict[str, Any]:
        return {"last_epoch": self.scheduler.last_epoch,
                "step_count": self.scheduler._step_count}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.scheduler.last_epoch = int(state["last_epoch"])
        self.scheduler._step_count = int(state["step_count"])
        self.scheduler._last_lr = [g["lr"] for g in self.scheduler.optimizer.param_groups]


@dataclass(frozen=True)
class Position:
    """Where the run is: optimizer steps done, and the data position they consumed. The loop
    owns the one current value; checkpoints save it and `read_position` gives it back."""

    step: int = 0
    epoch: int = 0
    step_in_epoch: int = 0  # global batches of `epoch` consumed by the loop

    def advanced(self, steps_per_epoch: int) -> "Position":
        """The position one optimizer step later."""
        step = self.step + 1
        return Position(step, *divmod(step, steps_per_epoch))


@dataclass(frozen=True)
class DataIdentity:
    """What the saved data position means something under."""

    seed: int
    dataset_size: int
    global_batch_size: int


def position_state(position: Position, identity: DataIdentity) -> Dict[str, Any]:
    """The checkpoint entries for `position`: `trainer` (the step) and `data` (the sampler's
    position, with the identity of the order it indexes into). Plain data, so a load fills
    the same dicts in place."""
    return {"trainer": {"step": position.step},
            "data": {"epoch": position.epoch, "step_in_epoch": position.step_in_epoch,
                     **asdict(identity)}}


def read_position(loaded: Dict[str, Any], identity: DataIdentity) -> Position:
    """The position `position_state` saved, once loaded; refuses another data order."""
    data = loaded["data"]
    saved = {k: int(data[k]) for k in asdict(identity)}
    if saved != asdict(identity):
        raise ConfigError(f"the checkpoint's data order was {saved}, this run's is "
                          f"{asdict(identity)}: resume with the same seed, dataset "
                          f"and data.global_batch_size, or start a new run (run.name=...)")
    return Position(int(loaded["trainer"]["step"]), int(data["epoch"]),
                    int(data["step_in_epoch"]))


def _rng_snapshot() -> Dict[str, Any]:
    version, mt, gauss = random.getstate()
    _, keys, pos, has_gauss, cached = np.random.get_state()
    snapshot = {
        "python": [version, list(mt), gauss],
        "numpy": [keys.tolist(), int(pos), int(has_gauss), float(cached)],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        snapshot["cuda"] = torch.stack(torch.cuda.get_rng_state_all())
    return snapshot


class RNGState:
    """This rank's RNGs, saved under `rank_<r>` (DCP would merge identical keys of ranks)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def state_dict(self) -> Dict[str, Any]:
        return {f"rank_{self.rank}": _rng_snapshot()}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        mine = state[f"rank_{self.rank}"]
        version, mt, gauss = mine["python"]
        random.setstate((int(version), tuple(int(x) for x in mt), gauss))
        keys, pos, has_gauss, cached = mine["numpy"]
        np.random.set_state(("MT19937", np.asarray(keys, dtype=np.uint32), int(pos),
                             int(has_gauss), float(cached)))
        torch.set_rng_state(mine["torch"])
        if "cuda" in mine and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(list(mine["cuda"]))

    def rederive(self, seed: int, step: int) -> None:
        """After a world-size change the saved per-rank streams do not map onto ranks: start
        fresh, reproducible ones from (seed, step, rank)."""
        derived = derive_seed(seed, step, self.rank)
        random.seed(derived)
        np.random.seed(derived % 2**32)
        torch.manual_seed(derived)


@dataclass
class RunInfo:
    """The MLflow run to keep logging into, the config that produced the checkpoint, and the
    name of the run it belongs to (never resume another run's checkpoint)."""

    mlflow_run_id: Optional[str]
    config: Dict[str, str]
    run_name: Optional[str] = None

    def state_dict(self) -> Dict[str, Any]:
        return {"mlflow_run_id": self.mlflow_run_id or "", "config": dict(self.config),
                "run_name": self.run_name or ""}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.mlflow_run_id = state["mlflow_run_id"] or None
        self.config = {str(k): str(v) for k, v in state["config"].items()}
        self.run_name = str(state["run_name"]) or None


def changed_keys(saved: Dict[str, str], current: Dict[str, str]) -> List[str]:
    return sorted(k for k in set(saved) | set(current) if saved.get(k) != current.get(k))

"""Fault injection for tests and demos, driven by `GOODPUT_FAULT`, so the production code
path runs unchanged: the trainer calls `faults.at(point, ...)` at a few named points, and
that does nothing unless a fault is due there (`NO_FAULTS`, the default, never is).

`GOODPUT_FAULT` holds faults separated by `;`, each `ACTION[:key=value...]`:

    kill:rank=1:step=5          SIGKILL rank 1 as it starts step 5
    kill:rank=0:save=2:phase=uploading
                                SIGKILL rank 0 inside its 2nd save (written, uploading,
                                uploaded, committing)
    kill:rank=0:at=load         SIGKILL rank 0 while it loads a checkpoint on resume
    kill:rank=0:at=allreduce:step=5
                                SIGKILL rank 0 as it hands its part to step 5's cross-replica
                                all-reduce, where its peers wait for it (strategy=ddp_ft)
    raise:rank=1:step=4         a Python exception
    nan:rank=1:step=6           rank 1's loss (and so its gradients) become NaN
    hang:rank=1:step=5          rank 1 spins in an endless loop (stuck in its own code)
    stop:rank=1:step=5          rank 1 sends itself SIGSTOP (frozen whole)
    corrupt:rank=1:step=8       rank 1's parameters silently drift after step 8
    preflight:rank=1            rank 1's device computes a wrong result in the pre-flight
    preflight:rank=1:ms=4000    ... and its process lingers 4 s at exit after its links
                                close (the slow teardown of a loaded machine)
    omit:keys=rng,data          leave those checkpoint keys out of every save and load (`data`:
                                the data position; the negative controls of the resume tests)
    static_split                strategy=ddp_ft: each replica group keeps its slot by replica
                                id whoever participates (the negative control of exactness)
    delay:ms=300                strategy=ddp_ft: every step at reduced width starts this much
                                later (survivors go on slowly while a killed group restarts)

Without `rank=` a fault fires on every rank. Each fires once per run: a marker under
`<run dir>/faults/` (holding the time it fired) keeps it from firing again after the
restart; `every=1` makes it fire on every attempt instead (`omit` always applies).
"""

from __future__ import annotations

import atexit
import logging
import math
import os
import re
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import torch

from train.errors import ConfigError

log = logging.getLogger(__name__)

FAULT_ENV = "GOODPUT_FAULT"
ACTIONS = ("kill", "raise", "nan", "hang", "stop", "corrupt", "preflight", "omit",
           "static_split", "delay")


class InjectedFault(RuntimeError):
    """The exception `raise:` throws."""


@dataclass(frozen=True)
class Fault:
    spec: str
    action: str
    rank: Optional[int] = None
    step: Optional[int] = None
    save: Optional[int] = None
    phase: Optional[str] = None
    at: Optional[str] = None
    keys: Tuple[str, ...] = ()
    every: bool = False
    ms: Optional[int] = None


def parse(text: str) -> List[Fault]:
    """The faults `text` names; a ConfigError (one line, exit 2) for anything else."""
    faults = []
    for spec in filter(None, (s.strip() for s in text.split(";"))):
        parts = spec.split(":")
        try:
            faults.append(_parse_one(spec, parts))
        except ValueError as err:  # int("x"), a field without "=", ...
            raise ConfigError(f"{FAULT_ENV}: cannot read '{spec}' ({err}): see the grammar "
                              f"in train/faults.py") from None
    return faults


def _parse_one(spec: str, parts: List[str]) -> Fault:
    if parts[0] not in ACTIONS:
        raise ValueError(f"unknown action; actions: {', '.join(ACTIONS)}")
    fields: Dict[str, str] = dict(p.split("=", 1) for p in parts[1:])
    ints = {k: int(fields.pop(k)) for k in ("rank", "step", "save", "ms") if k in fields}
    keys = tuple(filter(None, fields.pop("keys", "").split(",")))
    fault = Fault(spec, parts[0], phase=fields.pop("phase", None), at=fields.pop("at", None),
                  keys=keys, every=fields.pop("every", "0") == "1", **ints)
    if fields:
        raise ValueError(f"unknown key(s) {sorted(fields)}")
    return fault


class FaultHook:
    """What production code sees: `at(point, **context)` at a few named points, a no-op.

    The points: "step" (step=, as a step starts), "loss" (step=, loss=: may poison it in
    place), "stepped" (step=, model=), "preflight" (result=: may corrupt it in place),
    "load" (as a resume starts loading), "save" (phase=, step=: inside a save), "state"
    (state=: the checkpoint's `Stateful` parts, may lose some), "loaded" (state=: what a
    load gave back, may be changed), and for strategy=ddp_ft "allreduce" (step=: the
    cross-replica all-reduce is in flight) and "split" (split=, replica_id=,
    replica_groups=: this group's share of the step, may be changed in place) and
    "quorum" (participants=, replica_groups=: the step's quorum is agreed).
    """

    def at(self, point: str, **context: Any) -> None:
        pass


NO_FAULTS = FaultHook()


class Faults(FaultHook):
    """The faults that apply to this rank, each fired at most once per run."""

    def __init__(self, faults: List[Fault], rank: int, marker_dir: Path) -> None:
        self.faults = [f for f in faults if f.rank is None or f.rank == rank]
        self.rank, self.marker_dir = rank, marker_dir
        self.saves_written = 0

    @classmethod
    def from_env(cls, rank: int, run_dir: Path) -> FaultHook:
        faults = parse(os.environ.get(FAULT_ENV, ""))
        return cls(faults, rank, run_dir / "faults") if faults else NO_FAULTS

    def at(self, point: str, **context: Any) -> None:
        getattr(self, f"_at_{point}")(**context)

    def _marker(self, fault: Fault) -> Path:
        return self.marker_dir / f"{re.sub(r'[^A-Za-z0-9=_-]+', '_', fault.spec)}.rank{self.rank}"

    def _fire(self, fault: Fault) -> bool:
        """Claim `fault`: False when it already fired in this run."""
        if fault.every:
            return True
        marker = self._marker(fault)
        if marker.exists():
            return False
        # Durable before the fault: a SIGKILL right after must not let it fire again.
        self.marker_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            os.write(fd, repr(time.time()).encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        log.warning("fault injection (%s=%s): %s on rank %d", FAULT_ENV, fault.spec,
                    fault.action, self.rank)
        return True

    def _due(self, action: str, **where: object) -> Optional[Fault]:
        for fault in self.faults:
            if fault.action == action and all(getattr(fault, k) == v for k, v in where.items()):
                if self._fire(fault):
                    return fault
        return None

    def _at_step(self, step: int) -> None:
        if self._due("kill", step=step, at=None):
            os.kill(os.getpid(), signal.SIGKILL)
        if self._due("raise", step=step):
            raise InjectedFault(f"injected exception at step {step} on rank {self.rank}")
        if self._due("stop", step=step):
            os.kill(os.getpid(), signal.SIGSTOP)
        if self._due("hang", step=step):
            while True:  # stuck in our own code, GIL and all: only a watchdog ends this
                pass

    def _at_loss(self, step: int, loss: torch.Tensor) -> None:
        if self._due("nan", step=step):
            loss.mul_(math.nan)

    def _at_stepped(self, step: int, model: torch.nn.Module) -> None:
        if self._due("corrupt", step=step):
            with torch.no_grad():
                next(model.parameters()).add_(1e-3)  # silent: finite, plausible, wrong

    def _at_preflight(self, result: torch.Tensor) -> None:
        fault = self._due("preflight")
        if fault:
            result[17, 42] += 1.0  # what a bad GPU or a flipped bit in its memory looks like
            if fault.ms:  # atexit runs after the process group is shut down
                atexit.register(time.sleep, fault.ms / 1000)

    def _at_load(self) -> None:
        if self._due("kill", at="load"):
            os.kill(os.getpid(), signal.SIGKILL)

    def _at_allreduce(self, step: int) -> None:
        if self._due("kill", at="allreduce", step=step):
            os.kill(os.getpid(), signal.SIGKILL)

    def _at_quorum(self, participants: int, replica_groups: int) -> None:
        if participants < replica_groups:
            for fault in self.faults:
                if fault.action == "delay":
                    time.sleep((fault.ms or 0) / 1000)

    def _at_split(self, split: Dict[str, int], replica_id: int, replica_groups: int) -> None:
        if any(fault.action == "static_split" for fault in self.faults):
            split.update(part=replica_id, parts=replica_groups)

    def _at_save(self, phase: str, step: int) -> None:
        if phase == "written":
            self.saves_written += 1
        if self._due("kill", save=self.saves_written, phase=phase):
            os.kill(os.getpid(), signal.SIGKILL)

    def _omitted(self) -> List[str]:
        return [key for fault in self.faults if fault.action == "omit" for key in fault.keys]

    def _at_state(self, state: Dict[str, Any]) -> None:
        for key in self._omitted():
            state.pop(key, None)

    def _at_loaded(self, state: Dict[str, Any]) -> None:
        if "data" in self._omitted():  # the position saved without it: its epoch's start
            state["data"].update(epoch=0, step_in_epoch=0)

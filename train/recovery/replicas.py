"""In-band recovery on torchft (`strategy=ddp_ft`): a replica group that fails drops out of
the step, the others go on at a smaller width, and the failed group, once restarted, rejoins
by copying the live state from a healthy one. The survivors never restart.

Each data-parallel replica group is one torchrun job (of any number of ranks); the groups
meet under a torchft lighthouse, which agrees on a quorum for every step. What keeps the data
exact, which torchft's own sampler does not (it drops a dead group's batches):

- The global batch of step s is a pure function of (seed, epoch, step), as under every
  strategy. The step's participants split it among themselves: rank r of participant p of P
  (groups of W ranks) takes slot p*W + r of P*W (`data.sampler.split_bounds`).
- Each trainer's gradients (a mean over its samples) times its sample count are summed over
  its group and then over the groups, with the counts, and divided by the summed count: the
  mean over the whole global batch however it was split, bad files left out included.
  Floating-point buffers (BatchNorm statistics) are averaged the same way, so every group
  holds bit-equal state after every step.
- torchft's `should_commit` gates the optimizer step. A step that fails to commit (a peer died
  in the all-reduce) raises `StepNotCommitted`; the loop redoes it under the next quorum,
  re-split. The audit ledger records a step only once it committed.

What keeps the groups honest with each other:

- Groups train together only if they train the same thing on as many ranks: whenever the
  quorum's members change, every participant's rank 0 publishes its training config (what
  the run identity covers, `train.resume.checkpoint.training_config`, credentials stripped) and
  its rank count through the quorum's store before the process group forms, and before
  any heal. The group furthest ahead (at a tie, the lowest replica id)
  sets what is trained; a group that differs from it is refused with one line naming the
  keys (exit 2), and the others go on without it.
- After every `health.replica_check_steps`-th step, each group adds a bit-exact checksum
  of its parameters to the next step's all-reduce (in a slot of its own): groups that no
  longer agree (silent corruption) all roll back to a checkpoint no newer than the last
  check they passed.
- A group below `min_replicas` waits for more with back-off, up to
  `quorum_timeout_seconds`, then exits with one line (retryable, exit 1).
- Steps that a group trained alone, with no other group taking part after them, leave its
  final weights its own: said at the end in one warning, and in the goodput report.

Each group keeps its own run directory and checkpoints (`<run dir>/replica_<id>/`): a whole-job
failure (every group, or the lighthouse) resumes each group from its own newest checkpoint,
and the first quorum then heals the groups behind from the one furthest ahead. Only this
module imports torchft (the optional `ft` extra).
"""

from __future__ import annotations

import json
import logging
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any, Callable, Dict, Iterator, List, Optional, Set, Tuple

import torch
import torch.distributed as dist

from common.redact import one_line, strip_credentials
from train.records import events
from train.config import FaultToleranceConfig
from train.cluster.world import World
from train.errors import ConfigError, TrainingError
from train.faults import FaultHook
from train.recovery.health import HealthState, parameter_checksum
from train.cluster.rank_dirs import replica_dir_name
from train.resume.stateful import Position, SchedulerState, changed_keys

log = logging.getLogger(__name__)

Split = Tuple[int, int]  # (this trainer's slot, the step's number of slots)

class StepNotCommitted(RuntimeError):
    """The replica groups did not commit this step (a peer failed during it): redo it."""


class Replicas:
    """What the loop asks of the replica groups. This base, `NO_REPLICAS`, is every strategy
    but ddp_ft: one fixed world, nothing to agree on."""

    # Whether the model's forwards and backwards are collectives across the groups: ddp_ft's
    # model has no wrapper (so state-dict keys stay plain), and `train.learn.strategy` asks this.
    lockstep = False

    def join(self, position: Position) -> Position:
        """Before the first step: where to start (a healthy peer's position, if it is ahead)."""
        return position

    def start_step(self, position: Position) -> Optional[Position]:
        """Before each step: None to go on with the current batches, or the position to
        rebuild them at (the participants changed, or this group healed from a peer)."""
        return None

    def split(self) -> Optional[Split]:
        """This trainer's slot of the global batch for the batches built now (None: the
        fixed split by rank)."""
        return None

    def redo(self) -> None:
        """The step did not commit: its batches are spent, so rebuild them."""

    def ledger_slot(self) -> Dict[str, int]:
        """The audit ledger's `rank` and `world` for the step just committed ({}: the
        writer's own)."""
        return {}

    def drift(self) -> Optional[str]:
        """Why the replica groups' parameters no longer agree, found in the step just
        trained (None: they agree, or were not compared)."""
        return None

    def trusted_step(self) -> Optional[int]:
        """The newest step a rollback may go back to (None: any checkpoint)."""
        return None

    def metrics(self) -> Dict[str, float]:
        return {}

    def close(self) -> None:
        pass


NO_REPLICAS = Replicas()


def weighted_sums(model: torch.nn.Module, samples: int) -> torch.Tensor:
    """This trainer's addends of the step: its gradients (means over its `samples`) and
    floating-point buffers, times `samples`, then `samples` itself; flat, in fp32."""
    parts = [p.grad if p.grad is not None else torch.zeros_like(p)
             for p in model.parameters() if p.requires_grad]
    parts += [b for b in model.buffers() if b.is_floating_point()]
    flat = torch.cat([t.detach().reshape(-1).float() for t in parts])
    count = torch.full((1,), float(samples), device=flat.device)
    return torch.cat([flat * samples, count])


def apply_means(model: torch.nn.Module, sums: torch.Tensor) -> None:
    """Divide the summed addends by the summed count and put them back: every gradient
    becomes the mean over all samples of the step, every buffer their weighted mean. No
    sample anywhere (every file bad): gradients are zero and buffers stay."""
    total = sums[-1]
    params = [p for p in model.parameters() if p.requires_grad]
    buffers = [b for b in model.buffers() if b.is_floating_point()]
    offset = 0
    with torch.no_grad():
        for t, is_param in [(p, True) for p in params] + [(b, False) for b in buffers]:
            piece = sums[offset:offset + t.numel()].view_as(t)
            offset += t.numel()
            if is_param:
                if t.grad is None:
                    t.grad = torch.zeros_like(t)
                t.grad.copy_(piece / total if total > 0 else torch.zeros_like(piece))
            elif total > 0:
                t.copy_(piece / total)


# The parameter check's part of a step's all-reduce: a slot per participant holding its
# replica id + 1 (0: nobody wrote the slot) and its parameter checksum in four 16-bit pieces,
# each exact in fp32, so the sum over the groups (one writer per slot) loses no bit.
CHECK_SLOT = 5
# A group that cannot train yet (too few groups, or a peer being refused) asks again after
# this long, doubling up to the cap: never a busy loop against the lighthouse, and back
# before a lighthouse's join timeout (2 s in the README's example) forms a quorum without it.
BACKOFF_FIRST_SECONDS, BACKOFF_MAX_SECONDS = 0.1, 1.0


def checksum_slots(checksum: int, replica_id: int, slot: int, slots: int,
                   device: torch.device) -> torch.Tensor:
    """A participant's addend to the parameter check: zeros but for its own `slot`."""
    word = checksum & (2**64 - 1)
    out = torch.zeros(slots * CHECK_SLOT, device=device)
    out[slot * CHECK_SLOT:(slot + 1) * CHECK_SLOT] = torch.tensor(
        [replica_id + 1] + [(word >> (16 * i)) & 0xFFFF for i in range(4)],
        dtype=torch.float32)
    return out


def read_checksums(summed: torch.Tensor) -> Dict[int, int]:
    """{replica id: its parameter checksum} from the summed slots."""
    rows = summed.view(-1, CHECK_SLOT).to(torch.int64).tolist()
    return {row[0] - 1: sum(piece << (16 * i) for i, piece in enumerate(row[1:]))
            for row in rows}


def drift_of(checksums: Dict[int, int], step: int) -> Optional[str]:
    """Why the groups' parameters after `step` do not agree (None: they do)."""
    (first, value), *rest = sorted(checksums.items())
    differ = [replica for replica, other in rest if other != value]
    return (f"replica group checksum mismatch after step {step} (groups {differ} differ "
            f"from group {first})" if differ else None)


# What a group publishes besides its config: how many ranks it has (a group's rank r
# averages with rank r of every other group, so all must have as many).
RANKS_KEY = "ranks per group"


class GroupsDisagree(RuntimeError):
    """Raised in torchft's quorum thread: the quorum's groups do not train the same thing."""


def _not_our_refusal(record: logging.LogRecord) -> bool:
    """A filter for torchft's manager log: the refusal is said in one line by this module;
    torchft's traceback of it would bury that line."""
    return not (record.exc_info and isinstance(record.exc_info[1], GroupsDisagree))


@dataclass(frozen=True)
class Verdict:
    """What a quorum's participants learnt from comparing what they train."""

    refused: Optional[str] = None  # why this group may not train with the others
    others: Tuple[int, ...] = ()  # the replica ids of the groups refused


def judge(members: List[Dict[str, Any]], me: int) -> Verdict:
    """The group furthest ahead (at a tie, the lowest replica id) sets what is trained:
    every member (`replica_id`, `step`, `config`) whose config differs from its is refused."""
    reference = max(members, key=lambda m: (m["step"], -m["replica_id"]))
    odd = [m for m in members if m["config"] != reference["config"]]
    mine = next(m for m in members if m["replica_id"] == me)
    if mine not in odd:
        return Verdict(others=tuple(m["replica_id"] for m in odd))
    keys = changed_keys(reference["config"], mine["config"])
    shown = "; ".join(f"{k}={_shown(mine['config'].get(k))} here, "
                      f"{_shown(reference['config'].get(k))} there"
                      for k in keys[:5]) + (f"; {len(keys) - 5} more" if len(keys) > 5 else "")
    return Verdict(refused=(
        f"replica group {me} trains something else than replica group "
        f"{reference['replica_id']} (at step {reference['step']}) under the same lighthouse: "
        f"{shown}. Start every group with the same config and as many ranks (keys that do "
        f"not change what is trained, such as trainer.max_steps, data.num_workers or "
        f"checkpoint.*, may differ)"))


def _shown(value: Any) -> str:
    """A config value in the refusal: credentials stripped before it is cut (a cut URL's
    password, its "@" gone, would no longer be recognised as one)."""
    return "(absent)" if value is None else strip_credentials(str(value))[:40]


def identity_of(config: Dict[str, Any]) -> Dict[str, str]:
    """What a group publishes to its peers of what it trains: the training config with
    credentials stripped (two groups reading one bucket with different keys train the same
    thing, and no peer or refusal line gets a secret)."""
    return {key: strip_credentials(str(value)) for key, value in config.items()}


def spans(steps: List[int]) -> str:
    """[1, 2, 3, 7] -> '1-3, 7'."""
    out: List[List[int]] = []
    for step in sorted(steps):
        if out and step == out[-1][1] + 1:
            out[-1][1] = step
        else:
            out.append([step, step])
    return ", ".join(f"{a}-{b}" if b > a else f"{a}" for a, b in out)


class FaultTolerantReplicas(Replicas):
    """This trainer's membership of the replica groups, through a torchft `Manager`.
    `identity`: what this group trains (compared with every peer's before training with
    it); `check_every`: compare parameters across the groups every this many steps (0:
    never)."""

    lockstep = True

    def __init__(self, cfg: FaultToleranceConfig, world: World, device: torch.device,
                 model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 scheduler: torch.optim.lr_scheduler.LRScheduler, health: HealthState,
                 faults: FaultHook, identity: Dict[str, str], check_every: int) -> None:
        self.cfg, self.world, self.model, self.faults = cfg, world, model, faults
        self.optimizer, self.scheduler, self.health = optimizer, scheduler, health
        self.identity, self.check_every = identity_of(identity), check_every
        self.position = Position()
        self._verdict: Optional[Verdict] = None  # of the last quorum that formed a group
        self.manager = connect(cfg, world, device, self._state, self._load, self._agree)
        self._samples = 0  # trained by this trainer since the last gradient average
        self._healed: Optional[Position] = None
        self._quorum_done = False  # the next step's quorum already ran (in `join`)
        self._loader_split: Optional[Split] = None
        self._stale = False
        self._width: Optional[int] = None
        self._width_since = time.perf_counter()
        self._drift: Optional[str] = None  # the last step's parameter check failed
        self._trusted: Optional[int] = None  # the last step whose state the check matched
        self._alone: Set[int] = set()  # steps trained alone, no other group taking part since
        self.degraded_seconds = self.heal_seconds = 0.0
        model.register_forward_pre_hook(self._count)

    # -- the step's quorum ---------------------------------------------------------------

    def join(self, position: Position) -> Position:
        began = time.perf_counter()
        self._quorum(position)
        self._quorum_done = True
        log.info("replica group %d joined: %d of %d groups participate, from step %d (%.2fs)",
                 self.cfg.replica_id, self.manager.num_participants(), self.cfg.replica_groups,
                 self.position.step, time.perf_counter() - began)
        return self.position

    def start_step(self, position: Position) -> Optional[Position]:
        if not self._quorum_done:
            self._quorum(position)
        split = self._current_split()
        if self._healed is not None or self._stale or split != self._loader_split:
            self._healed, self._stale = None, False
            self._quorum_done = True  # the loop comes back for this very step
            return self.position
        self._quorum_done = False
        return None

    def _quorum(self, position: Position) -> None:
        """Quorums until one can train: wait for the lighthouse's agreement on who takes
        part in the next step; if this group is behind, copy a healthy peer's state (torchft
        heals here). Too few groups, or a peer being refused: ask again, backing off, up to
        `quorum_timeout_seconds`."""
        self.position = position
        if self.manager.current_step() != position.step:  # a resume or rollback moved us
            self.manager.load_state_dict({"step": position.step,
                                          "batches_committed": self.manager.batches_committed()})
        began = time.perf_counter()
        waiting_since, delay = None, BACKOFF_FIRST_SECONDS
        while True:
            self._start_quorum()
            waiting = self._why_not_train()
            if waiting is None:
                break
            now = time.perf_counter()
            if waiting_since is None:
                waiting_since = now
                log.warning("step %d: %s: waiting up to %gs for a quorum that can train",
                            position.step + 1, waiting, self.cfg.quorum_timeout_seconds)
            elif now - waiting_since > self.cfg.quorum_timeout_seconds:
                raise TrainingError(
                    f"{waiting} for {self.cfg.quorum_timeout_seconds:g}s "
                    f"(strategy.fault_tolerance.quorum_timeout_seconds): start the missing "
                    f"groups, or lower strategy.fault_tolerance.min_replicas; this group "
                    f"resumes from its checkpoint when run again")
            time.sleep(delay)
            delay = min(2 * delay, BACKOFF_MAX_SECONDS)
        if self._healed is not None:
            seconds = time.perf_counter() - began
            self.heal_seconds += seconds
            self._alone.clear()  # this group's own steps are gone: it holds a peer's state
            log.warning("replica group %d healed from a healthy peer: step %d -> %d in %.2fs",
                        self.cfg.replica_id, position.step, self._healed.step, seconds)
            events.record("heal", step=position.step, to_step=self._healed.step,
                          seconds=seconds)
            self.position = self._healed
        self._note_width(self.manager.num_participants())
        self.faults.at("quorum", participants=self.manager.num_participants(),
                       replica_groups=self.cfg.replica_groups)

    def _start_quorum(self) -> None:
        try:
            self.manager.start_quorum()
        except Exception as err:  # the lighthouse is gone, or no quorum within the timeout
            raise TrainingError(
                f"no quorum from the torchft lighthouse at {self.cfg.lighthouse} within "
                f"{self.cfg.quorum_timeout_seconds:g}s "
                f"({one_line(err, limit=200, named=False)}): "
                f"restart the lighthouse; this group resumes from its checkpoint when run "
                f"again") from None

    def _why_not_train(self) -> Optional[str]:
        """Why the quorum just agreed cannot train (None: it can). Raises `ConfigError` if
        this group trains something else than the others."""
        verdict = self._verdict  # kept until a new quorum forms a group: a refusal too
        if verdict is not None and verdict.refused:
            raise ConfigError(verdict.refused)
        if verdict is not None and verdict.others:
            return (f"replica group(s) {list(verdict.others)} train something else and are "
                    f"refused (each says which keys differ)")
        participants = self.manager.num_participants()
        if participants < self.cfg.min_replicas:
            return (f"{participants} of strategy.fault_tolerance.min_replicas="
                    f"{self.cfg.min_replicas} replica groups")
        return None

    def _agree(self, store_address: str, rank: int, world_size: int, quorum_id: int) -> None:
        """In torchft's quorum thread, as the quorum's members change, before the group of
        the participants forms and before any heal: publish what this group trains through
        the quorum's store, read every participant's, and judge. Raising here makes torchft
        drop this quorum (no heal, no collective); `_why_not_train` then says why.

        Only the groups' rank 0s meet (every group has one: torchft pairs rank r of each
        group, and a group with fewer ranks leaves a wider one's rank r without peers); each
        hands its verdict to its own ranks through its own store, so all of a group's ranks
        go on, or wait, together."""
        self._verdict = None
        own = dist.distributed_c10d._get_default_store() if self.world.world_size > 1 else None
        key = f"goodput/verdict/{quorum_id}"
        if self.world.rank == 0:
            try:
                verdict = self._judge_members(store_address, rank, world_size)
            except Exception as err:
                if own is not None:
                    own.set(key, json.dumps({"error": one_line(err, limit=200, named=False)}))
                raise
            if own is not None:
                own.set(key, json.dumps({"refused": verdict.refused,
                                         "others": list(verdict.others)}))
        else:
            own.wait([key], timedelta(seconds=self.cfg.timeout_seconds))
            record = json.loads(own.get(key))
            if "error" in record:
                raise RuntimeError(f"rank 0 could not compare the groups: {record['error']}")
            verdict = Verdict(record["refused"], tuple(record["others"]))
        if verdict.refused or verdict.others:
            self._verdict = verdict
            if verdict.others and self.world.rank == 0:
                log.warning("replica groups %s train something else: refused, going on "
                            "without them", list(verdict.others))
            raise GroupsDisagree(verdict.refused or f"refusing replica groups {verdict.others}")

    def _judge_members(self, store_address: str, rank: int, world_size: int) -> Verdict:
        """Rank 0's part of `_agree`: what every participant trains, and on how many ranks."""
        from torchft.process_group import create_store_client

        store = create_store_client(f"{store_address}/goodput_identity",
                                    timeout=timedelta(seconds=self.cfg.timeout_seconds))
        store.set(str(rank), json.dumps({
            "replica_id": self.cfg.replica_id, "step": self.manager.current_step(),
            "config": {**self.identity, RANKS_KEY: str(self.world.world_size)}}))
        members = [json.loads(store.get(str(r))) for r in range(world_size)]
        return judge(members, self.cfg.replica_id)

    def _note_width(self, participants: int) -> None:
        """Account the time since the last quorum as degraded if fewer groups than
        `replica_groups` took part; log and record each change of width."""
        now = time.perf_counter()
        if self._width is not None and self._width < self.cfg.replica_groups:
            self.degraded_seconds += now - self._width_since
        self._width_since = now
        if participants != self._width:
            log.warning("step %d: %d of %d replica groups participate", self.position.step + 1,
                        participants, self.cfg.replica_groups)
            events.record("regroup", step=self.position.step + 1, participants=participants)
        self._width = participants

    def _current_split(self) -> Split:
        """Slot p*W + r of P*W, P the step's participants (every member of a synchronous
        quorum participates), W this group's ranks."""
        group = self.world.world_size
        split = {"part": int(self.manager.participating_rank()),
                 "parts": self.manager.num_participants()}
        # The negative control of the exactness tests: keep the split fixed by replica id.
        self.faults.at("split", split=split, replica_id=self.cfg.replica_id,
                       replica_groups=self.cfg.replica_groups)
        return split["part"] * group + self.world.rank, split["parts"] * group

    def split(self) -> Split:
        self._loader_split = self._current_split()
        return self._loader_split

    def redo(self) -> None:
        self._stale = True

    def ledger_slot(self) -> Dict[str, int]:
        slot, slots = self._loader_split or (self.world.rank, self.world.world_size)
        return {"rank": slot, "world_size": slots}

    # -- the gradient average ------------------------------------------------------------

    def _count(self, module: torch.nn.Module, args: Tuple[Any, ...]) -> None:
        if module.training:  # stand-in forwards run in eval mode and carry no sample
            self._samples += args[0].shape[0]

    @contextmanager
    def averaging(self) -> Iterator[None]:
        """Around the last micro-batch's backward: then average over all participants, and
        commit the step or raise `StepNotCommitted`."""
        yield
        self.average_gradients()

    def average_gradients(self) -> None:
        step, self._drift = self.position.step + 1, None
        sums, self._samples = weighted_sums(self.model, self._samples), 0
        participants = self.manager.num_participants()
        # The state after step `step - 1`, a multiple of check_every: the state a checkpoint
        # of that step holds, so a failed check later rolls back to one that passed.
        checked = self.check_every > 0 and step > 1 and (step - 1) % self.check_every == 0
        if checked:  # in this group's slot (rank 0's)
            slots = (checksum_slots(int(parameter_checksum(self.model)), self.cfg.replica_id,
                                    int(self.manager.participating_rank()), participants,
                                    sums.device) if self.world.rank == 0
                     else torch.zeros(participants * CHECK_SLOT, device=sums.device))
            sums = torch.cat([sums, slots])
        if self.world.world_size > 1:  # this group's ranks first, then across the groups
            dist.all_reduce(sums)
        # Peers may already wait in the all-reduce for this trainer's part.
        self.faults.at("allreduce", step=step)
        self.manager.allreduce(sums, reduce_op=dist.ReduceOp.SUM).wait()
        if not self.manager.should_commit():
            raise StepNotCommitted(f"step {step} did not commit across the "
                                   f"replica groups ({self.manager.errored() or 'too few'})")
        if checked:
            sums, summed = sums[:-participants * CHECK_SLOT], sums[-participants * CHECK_SLOT:]
            self._drift = drift_of(read_checksums(summed), step - 1)
            if self._drift is None:
                self._trusted = step - 1
        if participants == 1 and self.cfg.replica_groups > 1:
            self._alone.add(step)
        else:  # another group holds this state too now
            self._alone.clear()
        apply_means(self.model, sums)

    def drift(self) -> Optional[str]:
        return self._drift

    def trusted_step(self) -> Optional[int]:
        """After a failed parameter check: the last step whose state every group held."""
        return self._trusted if self._drift else None

    # -- what a healing peer copies -------------------------------------------------------

    def _state(self) -> Dict[str, Any]:
        return {"model": self.model.state_dict(), "optim": self.optimizer.state_dict(),
                "scheduler": SchedulerState(self.scheduler).state_dict(),
                "health": self.health.state_dict(), "position": asdict(self.position)}

    def _load(self, state: Dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optim"])
        SchedulerState(self.scheduler).load_state_dict(state["scheduler"])
        self.health.load_state_dict(state["health"])
        self._healed = Position(**{k: int(v) for k, v in state["position"].items()})

    def metrics(self) -> Dict[str, float]:
        return {"goodput/degraded_seconds": self.degraded_seconds,
                "goodput/heal_seconds": self.heal_seconds,
                "ft/participants": float(self._width or 0)}

    def close(self) -> None:
        """At the end of the run: say if this group's last steps were its alone."""
        if self._alone:
            steps = spans(sorted(self._alone))
            log.warning("replica group %d trained steps %s alone, and no other group took "
                        "part after them: its final weights are its own (other groups' "
                        "model_final.pt differ)", self.cfg.replica_id, steps)
            events.record("alone", steps=steps, count=len(self._alone))
        self.manager.shutdown(wait=False)


def checked(base: type, agree: Callable[[str, int, int, int], None]) -> type:
    """The torchft process group `base`, calling `agree(store address, replica rank,
    replica world size, quorum id)` each time it is configured for a new quorum, before it
    connects. torchft configures it before any heal, and takes what `agree` raises as the quorum's
    error (no heal, no collective in that quorum)."""

    class Checked(base):  # type: ignore[misc, valid-type]
        def configure(self, store_addr: str, replica_id: str, rank: int, world_size: int,
                      quorum_id: int, *args: Any, **kwargs: Any) -> None:
            agree(store_addr, rank, world_size, quorum_id)
            super().configure(store_addr, replica_id, rank, world_size, quorum_id, *args,
                              **kwargs)

    return Checked


def connect(cfg: FaultToleranceConfig, world: World, device: torch.device,
            state_dict: Any, load_state_dict: Any,
            agree: Callable[[str, int, int, int], None]) -> Any:
    """A torchft `Manager` for this trainer: it reaches the lighthouse (group rank 0) and the
    store torchrun hosts (or init_world's, outside torchrun). `agree` judges every new
    quorum's members (`checked`)."""
    try:
        from torchft import Manager
        from torchft.checkpointing.pg_transport import PGTransport
        from torchft.process_group import ProcessGroupGloo, ProcessGroupNCCL
    except ImportError as err:
        raise ConfigError(f"strategy=ddp_ft needs torchft ({err}): pip install -e '.[ft]'"
                          ) from None
    logging.getLogger("torchft.manager").addFilter(_not_our_refusal)
    timeout = timedelta(seconds=cfg.timeout_seconds)
    pg = checked(ProcessGroupNCCL if device.type == "cuda" else ProcessGroupGloo,
                 agree)(timeout=timeout)
    try:
        return Manager(
            pg=pg, load_state_dict=load_state_dict, state_dict=state_dict,
            min_replica_size=cfg.min_replicas,
            # Synchronous: the split of a step's data needs its participants before the data
            # is fetched, and a healed group then takes part in the very step it joined.
            use_async_quorum=False,
            timeout=timeout, quorum_timeout=timedelta(seconds=cfg.quorum_timeout_seconds),
            connect_timeout=timedelta(seconds=cfg.connect_timeout_seconds),
            rank=world.rank, world_size=world.world_size, lighthouse_addr=cfg.lighthouse,
            replica_id=replica_dir_name(cfg.replica_id),
            checkpoint_transport=PGTransport(pg, timeout=timeout, device=device))
    except Exception as err:  # torchft raises plain RuntimeErrors from its Rust client
        raise TrainingError(
            f"cannot join the torchft lighthouse at {cfg.lighthouse} "
            f"({one_line(err, limit=200, named=False)}): start it (torchft_lighthouse "
            f"--min_replicas 1 "
            f"--bind HOST:PORT) or point strategy.fault_tolerance.lighthouse at it") from None


def check_fault_tolerance(grad_accum_steps: int, cfg: FaultToleranceConfig) -> None:
    """ddp_ft's split is per step, not per micro-batch: the sample weighting is exact only
    with one micro-batch per step. And a quorum must be reachable at the planned width."""
    if cfg.min_replicas > cfg.replica_groups:  # no step would commit: each waits, times out
        raise ConfigError(f"strategy.fault_tolerance.min_replicas={cfg.min_replicas} is above "
                          f"replica_groups={cfg.replica_groups}: no step could commit; set "
                          f"min_replicas <= replica_groups")
    if grad_accum_steps != 1:
        raise ConfigError(f"strategy=ddp_ft needs trainer.grad_accum_steps=1 (got "
                          f"{grad_accum_steps}): spread the batch over more groups or ranks instead, "
                          f"or use strategy=ddp")


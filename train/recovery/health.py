"""Health: decide, on all ranks together, when a step must not count.

A non-finite loss or gradient norm, or a loss spike beyond `health.spike_factor` x the
running median, on any rank, or DDP replicas whose parameters no longer agree: every rank
sees the same verdict (one small all-reduce per step), so all roll back together. The
offending step's global batch is then skipped for the rest of the run, deterministically:
the skipped steps are saved in every checkpoint and, at once, in `<run dir>/health.json`,
so a crash before the next checkpoint skips them again.

Hangs are a separate matter: `Watchdog` ends a rank that stops making progress.
"""

from __future__ import annotations

import faulthandler
import json
import logging
import math
import statistics
import sys
from collections import deque
from pathlib import Path
from typing import Any, Callable, Deque, Dict, FrozenSet, Iterable, Optional, Set, Tuple

import torch
import torch.distributed as dist

from common.distributed import any_rank
from common.files import atomic_write
from common.run_files import HEALTH_FILE
from train.config import HealthConfig
from train.errors import TrainingError

log = logging.getLogger(__name__)


class HealthState:
    """What the health checks remember: the loss window behind the running median, and the
    steps whose global batch is skipped (its one owner: only the methods below change it).
    Saved in checkpoints."""

    def __init__(self, window: int) -> None:
        self.losses: Deque[float] = deque(maxlen=window)
        self._skipped: Set[int] = set()

    @property
    def skipped(self) -> FrozenSet[int]:
        return frozenset(self._skipped)

    def skip(self, steps: Iterable[int]) -> None:
        """Skip these steps' global batches too: a union, as a rollback's skips are newer
        than the checkpoint it rolls back to, and a restart's than the last checkpoint."""
        self._skipped |= {int(s) for s in steps}

    def agree(self, broadcast: Callable[[Any], Any]) -> None:
        """Take rank 0's set (`broadcast`), so every rank skips the same global batches."""
        self._skipped = {int(s) for s in broadcast(sorted(self._skipped))}

    # JSON strings, not lists: DCP loads only the keys the live state already has, so a
    # list longer in the checkpoint than in a fresh process would load truncated.
    def state_dict(self) -> Dict[str, Any]:
        return {"losses": json.dumps(list(self.losses)),
                "skipped": json.dumps(sorted(self._skipped))}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.losses.clear()
        self.losses.extend(float(x) for x in json.loads(state["losses"]))
        self.skip(json.loads(state["skipped"]))


class HealthMonitor:
    def __init__(self, cfg: HealthConfig, state: HealthState, rank: int,
                 run_dir: Path, replicated: bool) -> None:
        self.cfg, self.state, self.rank = cfg, state, rank
        self.skips_file = run_dir / HEALTH_FILE
        self.replicated = replicated  # DDP: every rank holds the same parameters
        self.rollbacks = 0

    def load_skips(self, broadcast: Callable[[Any], Any]) -> None:
        """Add the steps a rollback skipped after the last checkpoint (rank 0 wrote them),
        and take rank 0's set (`broadcast`), so every rank skips the same global batches."""
        if self.skips_file.exists():
            self.state.skip(json.loads(self.skips_file.read_text())["skipped"])
        self.state.agree(broadcast)

    def check_step(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor,
                   stop_requested: bool = False) -> Tuple[Optional[str], bool]:
        """Why step `step` is bad on some rank (or None), and whether any rank was asked to
        stop (preemption); the same answers on every rank, from one all-reduce.

        Spikes are judged on the mean loss over ranks, which every rank then holds bit for
        bit: the window is saved in checkpoints, so it must not differ between ranks.
        """
        world = dist.get_world_size() if dist.is_initialized() else 1
        if not self.cfg.enabled:
            return None, any_rank(stop_requested, loss.device)
        loss_value, norm_value = float(loss), float(grad_norm)
        summed = torch.tensor([loss_value if math.isfinite(loss_value) else 0.0,
                               not math.isfinite(loss_value), not math.isfinite(norm_value),
                               stop_requested],
                              dtype=torch.float64, device=loss.device)  # NCCL: on the GPU
        if world > 1:
            dist.all_reduce(summed)
        total, bad_loss, bad_norm, stops = summed.tolist()
        mean_loss, bad_loss, bad_norm, stop = total / world, bad_loss > 0, bad_norm > 0, stops > 0
        spike = (not bad_loss and len(self.state.losses) >= self.cfg.min_history
                 and mean_loss > self.cfg.spike_factor * statistics.median(self.state.losses))
        if not (bad_loss or bad_norm or spike):
            self.state.losses.append(mean_loss)
            return None, stop
        what = [name for name, bad in [("non-finite loss", bad_loss),
                                       ("non-finite gradient norm", bad_norm),
                                       (f"loss spike to {mean_loss:.4g} (over "
                                        f"{self.cfg.spike_factor:g} x the running median)",
                                        spike)] if bad]
        return f"{' and '.join(what)} at step {step}", stop

    def check_replicas(self, step: int, model: torch.nn.Module) -> Optional[str]:
        """Every `replica_check_steps`, DDP ranks compare a checksum of their parameters:
        silent corruption (a bad GPU, a flipped bit) makes one replica drift."""
        every = self.cfg.replica_check_steps
        if (not self.cfg.enabled or not self.replicated or every <= 0 or step % every
                or not dist.is_initialized() or dist.get_world_size() == 1):
            return None
        mine = parameter_checksum(model)
        sums = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(sums, mine)
        if all(torch.equal(s, sums[0]) for s in sums):
            return None
        differ = [r for r, s in enumerate(sums) if not torch.equal(s, sums[0])]
        return f"replica checksum mismatch at step {step} (ranks {differ} differ from rank 0)"

    def count_rollback(self) -> None:
        self.rollbacks += 1
        if self.rollbacks > self.cfg.max_rollbacks:
            raise TrainingError(f"{self.rollbacks} rollbacks in this process, more than "
                                f"health.max_rollbacks={self.cfg.max_rollbacks}: the run "
                                f"keeps going bad (lower the lr, check the data, or raise "
                                f"the cap)")

    def skip(self, step: int) -> None:
        """Skip `step`'s global batch from now on (and after any restart)."""
        self.state.skip([step])
        if self.rank == 0:
            try:
                self.skips_file.parent.mkdir(parents=True, exist_ok=True)
                atomic_write(self.skips_file,
                             json.dumps({"skipped": sorted(self.state.skipped)}).encode())
            except OSError as err:  # the next checkpoint records the skip too
                log.warning("cannot write %s (%s): step %d is skipped in this process and "
                            "from the next checkpoint on", self.skips_file,
                            err.strerror or err, step)

    def skipped(self, step: int) -> bool:
        return step in self.state.skipped


def parameter_checksum(model: torch.nn.Module) -> torch.Tensor:
    """A bit-exact checksum of the parameters: their bytes as integers, summed (wrapping).
    Any changed bit changes it, unlike a float sum."""
    total = torch.zeros((), dtype=torch.int64)
    for p in model.parameters():
        data = p.detach().contiguous().view(-1)
        if data.element_size() == 4:
            words = data.view(torch.int32)
        elif data.element_size() == 2:
            words = data.view(torch.int16)
        else:
            words = data.view(torch.int64)
        total += words.to(torch.int64).sum().cpu()
    return total.reshape(1).to(next(model.parameters()).device)


class Watchdog:
    """Ends this rank, with every thread's stack on stderr, when `beat()` stops coming for
    `seconds`: torchrun then restarts the group instead of it hanging forever.

    It is faulthandler's timer, a C thread: it fires even when Python code spins with the
    GIL held, which a Python thread could not do.
    """

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def beat(self) -> None:
        if self.seconds > 0:
            faulthandler.dump_traceback_later(self.seconds, exit=True, file=sys.stderr)

    def __enter__(self) -> "Watchdog":
        self.beat()
        return self

    def __exit__(self, *exc: object) -> None:
        faulthandler.cancel_dump_traceback_later()

"""Pre-flight: before any real work, every rank checks that its device computes correctly
and that the collectives answer within the timeout.

A broken node should fail fast with its own exit code (EXIT_PREFLIGHT), naming itself, so a
scheduler can replace it, instead of the whole job hanging or training on garbage.
"""

from __future__ import annotations

import logging
import signal
import socket
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from common.redact import one_line
from train.cluster.world import World, launched_by_torchrun
from train.errors import PreflightError, TrainingError
from train.faults import NO_FAULTS, FaultHook

log = logging.getLogger(__name__)


def device_computes_correctly(device: torch.device, faults: FaultHook = NO_FAULTS) -> bool:
    """A matrix product on `device` against the same product in float64 on the CPU."""
    gen = torch.Generator().manual_seed(1234)
    a, b = torch.randn(256, 256, generator=gen), torch.randn(256, 256, generator=gen)
    expected = a.double() @ b.double()
    got = (a.to(device) @ b.to(device)).double().cpu()
    faults.at("preflight", result=got)
    # fp32 (or TF32 on CUDA) rounding of 256-term sums stays far below this.
    return bool(torch.allclose(got, expected, rtol=1e-2, atol=1e-1))


# How long a healthy rank waits for the broken ones to leave, and then for the launcher to
# act on their exit, before it goes anyway.
LEAVE_GRACE_S = 20.0


def wait_for_broken_ranks_to_leave(world: World) -> None:
    """Healthy ranks exit only after the broken ones: torchrun reports (and a scheduler
    acts on) the first worker it sees fail, and SIGTERMs the rest, so a healthy rank exiting
    first would hide the broken one's EXIT_PREFLIGHT.

    A barrier the broken ranks never enter fails as soon as their links close. That is not
    yet their exit: a loaded machine may take seconds to tear a process down after its
    process group is gone. So under torchrun a healthy rank then waits for the agent's
    SIGTERM, which it sends only once it has seen a worker exit, and leaves on it."""
    work = dist.barrier(group=world.control_group, async_op=True)
    try:
        work.wait(timedelta(seconds=LEAVE_GRACE_S))
    except RuntimeError:
        pass  # a peer left (or the grace ran out)
    if launched_by_torchrun():
        wait_for_sigterm(LEAVE_GRACE_S)


def wait_for_sigterm(timeout_s: float) -> bool:
    """Block until SIGTERM arrives or `timeout_s` passes; True if it came. The handler only
    notes it: the caller then leaves with its own error, not as a preempted run."""
    came: list = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: came.append(signum))
    try:
        deadline = time.monotonic() + timeout_s
        while not came and time.monotonic() < deadline:
            time.sleep(0.05)  # the handler runs between sleeps
        return bool(came)
    finally:
        signal.signal(signal.SIGTERM, previous)


def preflight(world: World, device: torch.device, timeout_s: float,
              faults: FaultHook = NO_FAULTS) -> None:
    """Raise PreflightError on a rank whose device or links fail. Healthy ranks learn which
    rank failed (the device verdicts travel in the collective check itself) and stop with
    a TrainingError naming it, so only the broken node reports EXIT_PREFLIGHT."""
    start = time.perf_counter()
    host = socket.gethostname()
    device_ok = device_computes_correctly(device, faults)
    verdicts = {}
    for name, group, on in (("training", None, device),
                            ("checkpoint", world.control_group, torch.device("cpu"))):
        mine = torch.tensor([float(device_ok)], device=on)
        everyone = [torch.zeros_like(mine) for _ in range(world.world_size)]
        work = dist.all_gather(everyone, mine, group=group, async_op=True)
        try:
            work.wait(timedelta(seconds=timeout_s))
        except RuntimeError as err:
            raise PreflightError(
                f"pre-flight: the {name} group's collectives on rank {world.rank} ({host}) "
                f"failed or did not answer within {timeout_s:g}s (strategy.timeout_seconds): "
                f"{one_line(err, named=False)}") from None
        verdicts[name] = [bool(v.item()) for v in everyone]
    if verdicts["training"] != verdicts["checkpoint"]:
        raise PreflightError(f"pre-flight: rank {world.rank} ({host}) received different data "
                             f"over its two process groups: replace this node")
    if not device_ok:
        raise PreflightError(f"pre-flight: {device} on rank {world.rank} ({host}) computed a "
                             f"wrong matrix product: replace this node")
    failed = [r for r, ok in enumerate(verdicts["training"]) if not ok]
    if failed:
        wait_for_broken_ranks_to_leave(world)
        raise TrainingError(f"pre-flight failed on rank(s) {failed}: see their logs; this "
                            f"rank ({world.rank}, {host}) is healthy")
    log.info("pre-flight passed in %.2fs: %s computes correctly, %d rank(s) answer",
             time.perf_counter() - start, device, world.world_size)

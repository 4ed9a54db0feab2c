"""Preemption: SIGTERM (schedulers, spot machines: "you have N seconds") and SIGINT (Ctrl-C).

The first signal only raises a flag. The loop finishes the step in flight, every rank agrees
on the step to stop at (the flag rides on the per-step health all-reduce), a checkpoint is
saved there and waited for until committed, and the process exits with `EXIT_PREEMPTED`,
which asks a scheduler to run the same command again. A second signal exits at once, with
the signal's own status, saving nothing more.

Under torchrun, signal the agent: it passes SIGTERM on to every worker's process group and
waits 30 s before killing them.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from contextlib import contextmanager
from types import FrameType
from typing import Iterator, Optional

from train.errors import EXIT_PREEMPTED

log = logging.getLogger(__name__)

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Preempted(Exception):
    """The run stopped early on a signal, after its checkpoint at `step` was committed."""

    def __init__(self, signal_name: str, step: int, saved: bool) -> None:
        self.signal_name, self.step, self.saved = signal_name, step, saved
        what = (f"checkpoint step {step} is committed" if saved else
                f"no checkpoint was saved (checkpoint.enabled=false): step {step}'s work is "
                f"lost")
        super().__init__(f"preempted by {signal_name} at step {step}: {what}; run the same "
                         f"command again to resume (exit code {EXIT_PREEMPTED}: requeue)")


class PreemptionFlag:
    """Set by the first SIGTERM/SIGINT; the loop polls `requested()` at step boundaries."""

    def __init__(self) -> None:
        self.signal_name: Optional[str] = None

    def requested(self) -> bool:
        return self.signal_name is not None

    def _handle(self, signum: int, frame: Optional[FrameType]) -> None:
        name = signal.Signals(signum).name
        if self.signal_name is None:
            self.signal_name = name
            _say(f"{name} received: finishing this step, then saving a checkpoint and "
                 f"exiting (send it again to exit at once, saving nothing)")
            return
        _say(f"second {name}: exiting now without a checkpoint")
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)


@contextmanager
def catch_preemption() -> Iterator[PreemptionFlag]:
    """Route SIGTERM and SIGINT to a `PreemptionFlag` while the body runs (main thread)."""
    flag = PreemptionFlag()
    previous = {s: signal.signal(s, flag._handle) for s in SIGNALS}
    try:
        yield flag
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def _say(line: str) -> None:
    # A raw write, not logging or print: the interrupted code may hold their locks.
    os.write(sys.stderr.fileno(), f"{line}\n".encode())

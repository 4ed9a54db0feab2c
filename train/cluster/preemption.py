"""Preemption: the signals that ask a run to stop (`trainer.stop_signals`).

SIGTERM (schedulers, spot machines: "you have N seconds"), SIGINT (Ctrl-C), SIGHUP (the
terminal went away; torchrun's agent forwards it) and the time-limit warnings SIGUSR1 and
SIGUSR2 (SLURM's `--signal=USR2@T`, submitit) all mean the same: save, then leave. The first
one only raises a flag. The loop finishes the step in flight, every rank agrees on the step
to stop at (the flag rides on the per-step health all-reduce), a checkpoint is saved there
and waited for until committed, and the process exits with `EXIT_PREEMPTED`, which asks a
scheduler to run the same command again.

A repeat is the same notice delivered twice (SLURM signals every process of a step, and
torchrun's agent forwards what its workers already got): it is noted, and the save goes on;
the scheduler's SIGKILL at the end of its grace period is the hard stop. Only a second
SIGINT (Ctrl-C again: a person in a hurry) exits at once, saving nothing more.

Before training (the imports, composing the config) there is nothing to save: a stop signal
exits at once with one line. After training (the process is on its way out) one is noted and
the run's own exit status stands; a later run of the same process (a multirun's next job)
starts with the notice, so it stops at its first step boundary.

A signal the process was started with ignored (`nohup` ignores SIGHUP) stays ignored. A
launcher that handles one of these signals itself (submitit requeues the job on SIGUSR2)
still does: its handler runs once the checkpoint is committed.

Under torchrun, a rank whose agent dies (of a signal the agent does not handle, or killed)
gets SIGTERM from the kernel (Linux's parent-death signal) and stops the same way.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
from contextlib import contextmanager
from types import FrameType
from typing import Any, Callable, Iterator, Optional, Sequence

from train.errors import EXIT_PREEMPTED

log = logging.getLogger(__name__)

# trainer.stop_signals' default (train/config.py). SIGQUIT is left out: Ctrl-\ is the way to
# end a run at once (with a core dump, as always).
DEFAULT_STOP_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGUSR1", "SIGUSR2")
# Exit status of a process stopped by SIGINT (128 + 2), as a shell reports it.
EXIT_INTERRUPTED = 130
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>

# A stop signal that came while no run was training (after one ended): the next run of
# this process starts stopping.
_pending: Optional[str] = None


class Preempted(Exception):
    """The run stopped early on a signal, after its checkpoint at `step` was committed."""

    def __init__(self, signal_name: str, step: int, saved: bool) -> None:
        self.signal_name, self.step, self.saved = signal_name, step, saved
        self.handed_on: Optional[Callable[[int, Optional[FrameType]], Any]] = None
        what = (f"checkpoint step {step} is committed" if saved else
                f"no checkpoint was saved (checkpoint.enabled=false): step {step}'s work is "
                f"lost")
        super().__init__(f"preempted by {signal_name} at step {step}: {what}; run the same "
                         f"command again to resume (exit code {EXIT_PREEMPTED}: requeue)")

    def hand_on(self) -> None:
        """Once the checkpoint is committed, run the handler that a launcher installed for
        this signal before the trainer did (submitit's SIGUSR2 handler requeues the job, and
        exits); nothing when there was none."""
        if self.handed_on is not None:
            self.handed_on(signal.Signals[self.signal_name], None)


def signals_named(names: Sequence[str]) -> list:
    """`signal.Signals` for names such as "SIGUSR2" (the config's enum keeps them valid)."""
    return [signal.Signals[str(getattr(name, "value", name))] for name in names]


class PreemptionFlag:
    """Set by the first stop signal; the loop polls `requested()` at step boundaries."""

    def __init__(self, signal_name: Optional[str] = None) -> None:
        self.signal_name = signal_name

    def requested(self) -> bool:
        return self.signal_name is not None

    def _handle(self, signum: int, frame: Optional[FrameType]) -> None:
        name = signal.Signals(signum).name
        if self.signal_name is None:
            self.signal_name = name
            _say(f"{name} received: finishing this step, then saving a checkpoint and "
                 f"exiting (Ctrl-C again exits at once, saving nothing)")
            return
        if signum == signal.SIGINT:
            _say("second SIGINT: exiting now without a checkpoint")
            _die_of(signum)
        _say(f"{name} received while stopping: the checkpoint after this step is still "
             f"saved (only a second Ctrl-C exits at once)")


def _before_training(signum: int, frame: Optional[FrameType]) -> None:
    """Nothing has been trained: one line instead of a traceback from whatever import was
    running, and an exit code that says what to do."""
    if signum == signal.SIGINT:
        print("interrupted before training started: nothing to save", file=sys.stderr)
        raise SystemExit(EXIT_INTERRUPTED)
    print(f"{signal.Signals(signum).name} received before training started: nothing to "
          f"save; run the same command again (exit code {EXIT_PREEMPTED}: requeue)",
          file=sys.stderr)
    raise SystemExit(EXIT_PREEMPTED)


def _after_training(signum: int, frame: Optional[FrameType]) -> None:
    global _pending
    name = signal.Signals(signum).name
    if _pending is not None and signum == signal.SIGINT:
        _die_of(signum)
    _pending = _pending or name
    _say(f"{name} received after training ended: the run's exit status stands")


def catch_start_up(parent_pid: int) -> None:
    """The first thing `python -m train` does: stop signals exit with one line until
    training routes them to a flag. Under torchrun also ask the kernel for a SIGTERM when
    the agent (`parent_pid`, read before any import) dies, so that a dead agent's workers
    stop at a checkpoint instead of training on unsupervised."""
    for sig in _not_ignored(DEFAULT_STOP_SIGNALS):
        signal.signal(sig, _before_training)
    if "TORCHELASTIC_RUN_ID" in os.environ and sys.platform.startswith("linux"):
        # The kernel sends it as each of the agent's threads exits: a repeat, which changes
        # nothing (see PreemptionFlag)
        if (ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) == 0
                and os.getppid() != parent_pid):  # it died before the request: no signal comes
            os.kill(os.getpid(), signal.SIGTERM)


@contextmanager
def catch_preemption(names: Sequence[str] = DEFAULT_STOP_SIGNALS) -> Iterator[PreemptionFlag]:
    """Route the stop signals `names` to a `PreemptionFlag` while the body runs (main
    thread); the other signals of DEFAULT_STOP_SIGNALS get their default action back. A
    notice that came between runs of this process is already set."""
    global _pending
    flag, _pending = PreemptionFlag(_pending), None
    chosen = _not_ignored(names)
    for sig in signals_named(DEFAULT_STOP_SIGNALS):
        if sig not in chosen and signal.getsignal(sig) in (_before_training, _after_training):
            signal.signal(sig, signal.SIG_DFL)
    launchers = {sig: handler for sig in chosen if _foreign(handler := signal.getsignal(sig))}
    for sig in chosen:
        signal.signal(sig, flag._handle)
    try:
        yield flag
    except Preempted as stopped:
        if stopped.signal_name in signal.Signals.__members__:
            stopped.handed_on = launchers.get(signal.Signals[stopped.signal_name])
        raise
    finally:
        for sig in chosen:
            signal.signal(sig, _after_training)


def _not_ignored(names: Sequence[str]) -> list:
    """The signals of `names` this process does not ignore: one it was started with ignored
    (nohup's SIGHUP) stays ignored, as whoever started it asked."""
    return [sig for sig in signals_named(names) if signal.getsignal(sig) != signal.SIG_IGN]


def _foreign(handler: Any) -> bool:
    """A Python handler someone else installed (a launcher's), not a default or ours."""
    return (callable(handler) and handler not in (signal.default_int_handler, _before_training,
                                                   _after_training)
            and not isinstance(getattr(handler, "__self__", None), PreemptionFlag))


def _die_of(signum: int) -> None:
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def _say(line: str) -> None:
    # A raw write, not logging or print: the interrupted code may hold their locks.
    os.write(sys.stderr.fileno(), f"{line}\n".encode())

"""Process liveness, for telling a live holder of a lock or reservation from a dead one; the
trainer's stop signals kept from the helpers it starts."""

from __future__ import annotations

import os
import signal
from contextlib import contextmanager
from multiprocessing import resource_tracker
from pathlib import Path
from typing import Iterator, Optional

# The signals that may ask the trainer to stop (trainer.stop_signals' choices) but SIGTERM,
# by which multiprocessing ends its helpers (a helper blocking it would hang the exit)
STOP_SIGNALS_BUT_TERM = (signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1,
                         signal.SIGUSR2)


@contextmanager
def stop_signals_kept_from_helpers() -> Iterator[None]:
    """Around a call that may start helper threads and processes with multiprocessing (DCP's
    checkpoint process, its executor thread, multiprocessing's resource tracker): the stop
    signals but SIGTERM blocked in this thread, so that the helpers start, and stay, with
    them blocked. A scheduler signals every process of a job (SLURM's --signal), a terminal
    its foreground group; a helper that died of it would fail the very save the trainer
    stops to make. The trainer's own signals wait, not lost, until the call returns."""
    before = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS_BUT_TERM)
    # Started here, and blocked again after: multiprocessing starts its tracker with SIGINT and
    # SIGTERM blocked, then unblocks both in the calling thread (here, not in a helper).
    resource_tracker.ensure_running()
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS_BUT_TERM)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


def leave_the_process_group_once() -> None:
    """For a helper process (DCP's checkpoint process): a process group of its own, so that
    the SIGTERM torchrun's agent sends its worker's whole group misses it (the worker stops
    at a checkpoint that this helper writes). Nothing after the first call."""
    global _left
    if not _left:
        os.setpgid(0, 0)
        _left = True


_left = False


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid lives on this host."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it lives, under another user
        return True
    return True


def started_at(pid: int) -> Optional[float]:
    """When process `pid` started (wall clock, to about a second: the boot time is whole
    seconds), or None where /proc does not say."""
    try:
        # the fields after the command name, which may hold spaces and parentheses
        fields = Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()
        booted = next(int(line.split()[1])
                      for line in Path("/proc/stat").read_bytes().splitlines()
                      if line.startswith(b"btime "))
        return booted + int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22: start time
    except (OSError, ValueError, IndexError, StopIteration):
        return None

"""Process liveness, for telling a live holder of a lock or reservation from a dead one."""

from __future__ import annotations

import os


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid lives on this host."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it lives, under another user
        return True
    return True

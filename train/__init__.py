"""The training application: `python -m train +experiment=resnet`."""

import time

# Goodput counts start-up from here, the first thing `python -m train` runs, so the time
# spent importing torch after a restart is counted too (train/records/goodput.py).
PROCESS_START = time.perf_counter()
_jobs_started = 0


def job_start() -> float:
    """When this job's start-up began (`time.perf_counter()`): the process start for the
    first job of a process, now for each later one (a multirun runs its jobs one after
    another in one process, and the earlier jobs' time is theirs, not this one's)."""
    global _jobs_started
    _jobs_started += 1
    return PROCESS_START if _jobs_started == 1 else time.perf_counter()

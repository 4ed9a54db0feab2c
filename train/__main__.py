"""Entry point: `python -m train +experiment=resnet [key=value ...]` (add `-m` to sweep).

Under torchrun every rank runs this with the same arguments (train/cluster/rank_dirs.py).
"""

import os

_PARENT = os.getppid()  # before the slow imports: torchrun's agent, when it launched us

from train.cluster.preemption import catch_start_up  # noqa: E402  (no torch)

catch_start_up(_PARENT)  # first: the imports below take seconds

import logging  # noqa: E402
import sys  # noqa: E402
from typing import Dict, NoReturn, Optional  # noqa: E402

import hydra  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

from common.redact import one_line  # noqa: E402
from train.config import register_configs, validate  # noqa: E402
from train.errors import EXIT_CONFIG, ConfigError  # noqa: E402
from train.cluster.rank_dirs import refuse_multirun_under_torchrun  # noqa: E402

register_configs()

# Hydra ends with exit code 1 both when composing fails (a misspelt key, a bad type, an
# unknown config group option: the user must fix it) and when the task fails (possibly
# retryable). Only the first happens before the task function is entered in this process,
# and Hydra raises its exit while handling the error it reports; a sweep whose jobs ran in
# other processes (joblib, submitit) ends with a job's own exit code, raised as it is.
_entered = False


def _unexpected(err: Exception) -> NoReturn:
    """An error nobody anticipated: its traceback goes to the log file alone (through the
    handler's credential filter), the console gets one line without credentials. Left to
    Hydra, it would print every override verbatim, a password in `data.root` included."""
    log = logging.getLogger("train")
    record = log.makeRecord(log.name, logging.ERROR, __file__, 0, "unexpected error", None,
                            sys.exc_info())
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler):
            handler.handle(record)
    print(f"error: {one_line(err)} (unexpected: the "
          f"traceback is in the run's log file)", file=sys.stderr)
    raise SystemExit(1)  # not EXIT_CONFIG: it may be transient, a restart may help


def objective(metrics: Dict[str, float], key: str) -> float:
    """The value a sweeper optimizes: the run's last `key` (`sweep.objective`; a run that was
    already complete reports what it reached). A key the run never logs is the user's
    mistake, said in one line."""
    if key not in metrics:
        raise ConfigError(f"sweep.objective={key} is not a metric of this run: choose one of "
                          f"{', '.join(sorted(metrics))}")
    return float(metrics[key])


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> Optional[float]:
    """One run; returns its objective (`sweep.objective`), so any Hydra sweeper can optimize
    it."""
    global _entered
    _entered = True
    refuse_multirun_under_torchrun()
    try:
        try:
            validate(cfg)
            from train.app import run  # torch and friends load once the config is known good

            return objective(run(cfg), cfg.sweep.objective)
        except ConfigError as err:
            print(f"error: {err}", file=sys.stderr)
            raise SystemExit(EXIT_CONFIG) from None
    except Exception as err:  # noqa: BLE001  anything run() does not turn into one line
        _unexpected(err)


if __name__ == "__main__":
    try:
        main()
    except SystemExit as exit_:
        if exit_.code == 1 and not _entered and isinstance(exit_.__context__, Exception):
            raise SystemExit(EXIT_CONFIG) from None
        raise

"""`hydra/sweeper=goodput_optuna`: ask Optuna for trials, launch them, tell it the results.

The plugin class Hydra's scan finds; the work is in `_impl` (which the scan skips), so that
Optuna loads only for a sweep that uses it.
"""

import os
import sys
from typing import Any, List, Optional, Sequence

from hydra.core.utils import JobReturn
from hydra.plugins.sweeper import Sweeper
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig

from hydra_plugins.goodput_optuna_sweeper import config  # noqa: F401  registers the configs


class OptunaSweeper(Sweeper):
    def __init__(self, sampler: DictConfig, direction: Any, storage: Optional[Any],
                 study_name: Optional[str], n_trials: int, n_jobs: int,
                 max_failure_rate: float, params: Optional[DictConfig],
                 custom_search_space: Optional[str], seed: Optional[int]) -> None:
        from hydra_plugins.goodput_optuna_sweeper._impl import OptunaSweeperImpl

        self.sweeper = OptunaSweeperImpl(
            sampler=sampler, direction=direction, storage=storage, study_name=study_name,
            n_trials=n_trials, n_jobs=n_jobs, max_failure_rate=max_failure_rate,
            params=params, custom_search_space=custom_search_space, seed=seed)

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction,
              config: DictConfig) -> None:
        self.sweeper.setup(hydra_context=hydra_context, task_function=task_function,
                           config=config)

    def sweep(self, arguments: List[str]) -> List[Sequence[JobReturn]]:
        """One list of job returns per batch, as Hydra's own sweepers return them. Bad input
        (the search space, the storage, a key's value) ends the sweep with one line and exit
        code 2; HYDRA_FULL_ERROR=1 shows its traceback instead."""
        from hydra_plugins.goodput_optuna_sweeper._impl import SweepError

        try:
            return self.sweeper.sweep(arguments)
        except SweepError as err:
            if os.environ.get("HYDRA_FULL_ERROR") == "1":
                raise
            print(f"error: {err}", file=sys.stderr)
            raise SystemExit(2) from None

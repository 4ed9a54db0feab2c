"""`hydra/sweeper=goodput_optuna`: ask Optuna for trials, launch them, tell it the results.

The search space is written in Hydra's override grammar, as hydra-optuna-sweeper does:
`interval(a, b)` a float range (`tag(log, interval(a, b))` on a log scale, `tag(int, ...)`
whole numbers), `choice(x, y)` or `x,y` a categorical, `range(a, b, s)` its values as a
categorical; a plain value is the same in every trial. Each trial is one job of the
launcher (basic: one after another; joblib, submitit: `n_jobs` at a time), and the value
Optuna is told is what the job's task function returned (`sweep.objective`).
"""

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from hydra.core.config_store import ConfigStore
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import ChoiceSweep, IntervalSweep, Override, RangeSweep
from hydra.core.plugins import Plugins
from hydra.core.utils import JobReturn
from hydra.errors import HydraException
from hydra.plugins.launcher import Launcher
from hydra.plugins.sweeper import Sweeper
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, OmegaConf

log = logging.getLogger(__name__)


# No `from __future__ import annotations` in this module: Hydra's plugin scan runs it outside
# sys.modules, where dataclasses cannot resolve string annotations.
@dataclass
class OptunaSweeperConf:
    _target_: str = "hydra_plugins.goodput_optuna_sweeper.optuna_sweeper.OptunaSweeper"
    # maximize or minimize the jobs' returned values (Any: `${sweep.direction}` is an Enum)
    direction: Any = "maximize"
    study_name: str = "goodput"
    # Where the study persists, so a sweep run again continues it: an RDB URL
    # (sqlite:///optuna.db; never MLflow's own database) or a journal file path. null: memory.
    storage: Optional[str] = None
    n_trials: int = 20  # trials this sweep adds to the study
    n_jobs: int = 1  # trials launched at once (the launcher runs them in parallel or not)
    seed: Optional[int] = None  # the sampler's
    n_startup_trials: int = 10  # random trials before TPE models the results
    params: Dict[str, str] = field(default_factory=dict)  # key: search space (grammar above)


ConfigStore.instance().store(group="hydra/sweeper", name="goodput_optuna",
                             node=OptunaSweeperConf, provider="goodput-trainer")


def distribution(override: Override) -> Any:
    """The Optuna distribution of a sweep override (see the module docstring)."""
    import optuna.distributions as dist

    value = override.value()
    if isinstance(value, IntervalSweep):
        log_scale = "log" in value.tags
        if "int" in value.tags:
            return dist.IntDistribution(int(value.start), int(value.end), log=log_scale)
        return dist.FloatDistribution(value.start, value.end, log=log_scale)
    if isinstance(value, ChoiceSweep):
        return dist.CategoricalDistribution(value.list)
    if isinstance(value, RangeSweep):
        return dist.CategoricalDistribution(list(override.sweep_iterator()))
    raise HydraException(f"{override.input_line}: not a search space Optuna can sample")


def open_storage(storage: Optional[str]) -> Any:
    """None (in memory), an RDB URL, or a journal file (any path without `://`)."""
    if storage is None or "://" in storage:
        if storage and storage.startswith("sqlite:///"):
            Path(storage[len("sqlite:///"):]).parent.mkdir(parents=True, exist_ok=True)
        return storage
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    Path(storage).parent.mkdir(parents=True, exist_ok=True)
    return JournalStorage(JournalFileBackend(storage))


class OptunaSweeper(Sweeper):
    def __init__(self, direction: Any, study_name: str, storage: Optional[str], n_trials: int,
                 n_jobs: int, seed: Optional[int], n_startup_trials: int,
                 params: Dict[str, str]) -> None:
        self.direction = str(getattr(direction, "value", direction))  # an Enum from ${...}
        if self.direction not in ("maximize", "minimize"):
            raise HydraException(f"hydra.sweeper.direction={self.direction}: it must be "
                                 f"maximize or minimize")
        if n_trials < 1 or n_jobs < 1:
            raise HydraException(f"hydra.sweeper.n_trials={n_trials}, n_jobs={n_jobs}: both "
                                 f"must be at least 1")
        self.study_name, self.storage = study_name, storage
        self.n_trials, self.n_jobs = n_trials, n_jobs
        self.seed, self.n_startup_trials = seed, n_startup_trials
        self.params = dict(params or {})
        self.config: Optional[DictConfig] = None
        self.hydra_context: Optional[HydraContext] = None
        self.launcher: Optional[Launcher] = None

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction,
              config: DictConfig) -> None:
        self.config, self.hydra_context = config, hydra_context
        self.launcher = Plugins.instance().instantiate_launcher(
            hydra_context=hydra_context, task_function=task_function, config=config)

    def sweep(self, arguments: List[str]) -> List[JobReturn]:
        import optuna

        assert self.config is not None and self.launcher is not None
        space, fixed = self.search_space(arguments)
        study = optuna.create_study(
            study_name=self.study_name, storage=open_storage(self.storage),
            direction=self.direction, load_if_exists=True,
            sampler=optuna.samplers.TPESampler(seed=self.seed,
                                               n_startup_trials=self.n_startup_trials))
        log.info("Optuna study %s (%s, %d trials so far): %d trials over %s", self.study_name,
                 self.storage or "in memory", len(study.trials), self.n_trials,
                 ", ".join(f"{k} {d}" for k, d in space.items()))
        sweep_dir = Path(self.config.hydra.sweep.dir)
        sweep_dir.mkdir(parents=True, exist_ok=True)
        OmegaConf.save(self.config, sweep_dir / "multirun.yaml")
        returns: List[JobReturn] = []
        while len(returns) < self.n_trials:
            trials = [study.ask(space) for _ in range(min(self.n_jobs,
                                                          self.n_trials - len(returns)))]
            batch = [fixed + [f"{key}={value!r}" if isinstance(value, str) else
                              f"{key}={value}" for key, value in trial.params.items()]
                     for trial in trials]
            self.validate_batch_is_legal(batch)
            results = self.launcher.launch(batch, initial_job_idx=len(returns))
            for trial, overrides, result in zip(trials, batch, results):
                trial.set_user_attr("overrides", overrides)
                tell(study, trial, result)
            returns.extend(results)
        self.report(study, sweep_dir)
        return returns

    def search_space(self, arguments: List[str]) -> Tuple[Dict[str, Any], List[str]]:
        """The distributions to sample, and the overrides every trial gets; the command line
        wins over `params`, key by key."""
        assert self.hydra_context is not None
        parser = OverridesParser.create(config_loader=self.hydra_context.config_loader)
        overrides = {o.get_key_element(): o for o in parser.parse_overrides(
            [f"{k}={v}" for k, v in self.params.items()] + list(arguments))}
        space = {key: distribution(o) for key, o in overrides.items() if o.is_sweep_override()}
        fixed = [o.input_line for o in overrides.values() if not o.is_sweep_override()]
        if not space:
            raise HydraException("hydra.sweeper.params holds no search space: add one, e.g. "
                                 "optim.lr='tag(log, interval(1e-4, 1e-2))'")
        return space, [line for line in fixed if line is not None]

    def report(self, study: Any, sweep_dir: Path) -> None:
        """Log the best trial of the whole study and write it to optimization_results.yaml."""
        complete = [t for t in study.trials if t.value is not None]
        if not complete:
            log.warning("Optuna study %s has no complete trial yet", self.study_name)
            return
        best = study.best_trial
        log.info("best of %d trials (%s): %s with %s", len(complete), self.direction,
                 best.value, " ".join(f"{k}={v}" for k, v in best.params.items()))
        OmegaConf.save(OmegaConf.create({"name": "optuna", "best_params": best.params,
                                         "best_value": best.value,
                                         "best_overrides": best.user_attrs.get("overrides")}),
                       sweep_dir / "optimization_results.yaml")


def tell(study: Any, trial: Any, result: JobReturn) -> None:
    """The job's value to Optuna; a job that failed or returned no number fails its trial
    (the sweep goes on: one bad corner of the space must not end it)."""
    from optuna.trial import TrialState

    try:
        value = float(result.return_value)
    except Exception as err:  # the job's own error, re-raised by return_value, or None
        log.warning("trial %d failed: %s", trial.number, err)
        study.tell(trial, state=TrialState.FAIL)
        return
    study.tell(trial, value)

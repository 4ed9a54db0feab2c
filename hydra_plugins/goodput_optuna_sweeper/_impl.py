"""The Optuna sweeper's work: the search space, the study, the batches of trials.

The search space is written in Hydra's override grammar, read as hydra-optuna-sweeper reads
it: `choice(a, b)` or `a,b` and `shuffle(range(...))` a categorical; `range(a, b[, step])`
whole numbers from a to b, or floats with that step if any bound is a float;
`interval(a, b)` floats, `int(interval(a, b))` (or our `tag(int, interval(a, b))`) whole
numbers, `tag(log, ...)` either on a log scale. A plain value is the same in every trial.

Each trial is one job of the launcher; `n_jobs` trials are asked for and launched at once (a
batch), and Optuna is told what each job's task function returned. A failed job fails its
trial; more than `max_failure_rate` of a batch failing ends the sweep. No trial is left
RUNNING: a sweep stopped by an error or a signal fails the trials it had launched (and asks
for an interrupted one again, first, when the same sweep runs again).
"""

import itertools
import logging
import math
import random
import re
import sqlite3
from contextlib import closing, contextmanager
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import optuna
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override, Transformer
from hydra.core.plugins import Plugins
from hydra.core.utils import JobReturn, JobStatus
from hydra.errors import CompactHydraException
from hydra.types import HydraContext, TaskFunction
from hydra.utils import get_method, get_object, instantiate
from omegaconf import DictConfig, ListConfig, OmegaConf
from optuna.distributions import (BaseDistribution, CategoricalDistribution, FloatDistribution,
                                  IntDistribution)
from optuna.trial import Trial, TrialState

from common.redact import one_line, strip_credentials

log = logging.getLogger(__name__)

# A job that exits with one of these was stopped by a signal: the sweep stops with it.
# 75 is sysexits.h's EX_TEMPFAIL ("run it again"), what a preempted run exits with; above
# 128 a shell's 128 + signal number.
EXIT_TEMPFAIL = 75


class SweepError(CompactHydraException):
    """Bad sweeper input, said in one line."""


class JobExit(Exception):
    """A job that ended by SystemExit, as its trial's failure: Hydra's `run_job` records an
    exception in the job's return, but lets an exit through to end the sweep (and joblib
    re-raises it in the sweep's process)."""

    def __init__(self, code: Any) -> None:
        super().__init__(code)
        self.code = code

    def __str__(self) -> str:
        return f"the job exited with code {self.code}"


def interrupted(code: Any) -> bool:
    return code == EXIT_TEMPFAIL or (isinstance(code, int) and code > 128)


class GuardedTask:
    """The task function as the launcher runs it: a job's exit becomes its trial's failure,
    except an interrupted job's, which stops the sweep (a class, not a closure: the joblib and
    submitit launchers pickle it)."""

    def __init__(self, task_function: TaskFunction) -> None:
        self.task_function = task_function

    def __call__(self, cfg: DictConfig) -> Any:
        try:
            return self.task_function(cfg)
        except SystemExit as exit_:
            if interrupted(exit_.code):
                raise
            raise JobExit(exit_.code) from None


class GridSampler(optuna.samplers.GridSampler):
    """Optuna's grid sampler. Without a seed it walks the grid in the order of Hydra's basic
    sweeper (the keys as written, the last one changing fastest), where Optuna's shuffles it
    (by seed 0 when none is given)."""

    def __init__(self, search_space: Dict[str, Sequence[Any]], seed: Optional[int] = None) -> None:
        super().__init__(search_space, seed)
        if seed is None:
            self._search_space = {key: list(values) for key, values in search_space.items()}
            self._param_names = list(self._search_space)
            self._all_grids = list(itertools.product(*self._search_space.values()))


def motpe_sampler(n_ehvi_candidates: int = 24, **options: Any) -> optuna.samplers.TPESampler:
    """hydra-optuna-sweeper's `motpe`: Optuna 4 folded MOTPESampler into TPESampler."""
    return optuna.samplers.TPESampler(n_ei_candidates=n_ehvi_candidates, **options)


def distribution(override: Override) -> BaseDistribution:
    """The Optuna distribution of a sweep override (the grammar in the module docstring)."""
    value, line = override.value(), override.input_line

    def bounded(low: Any, high: Any, log_scale: bool = False) -> None:
        if low > high:
            raise SweepError(f"hydra.sweeper.params: {line}: its low end {low} is above its "
                             f"high end {high}: swap them")
        if log_scale and low <= 0:
            raise SweepError(f"hydra.sweeper.params: {line}: a log scale needs a low end above "
                             f"0, not {low}")

    try:
        if override.is_choice_sweep() or (override.is_range_sweep() and value.shuffle):
            return CategoricalDistribution(
                list(override.sweep_iterator(transformer=Transformer.encode)))
        if override.is_range_sweep():
            bounded(value.start, value.stop)
            if any(isinstance(x, float) for x in (value.start, value.stop, value.step)):
                return FloatDistribution(float(value.start), float(value.stop),
                                         step=float(value.step))
            return IntDistribution(int(value.start), int(value.stop), step=int(value.step))
        if override.is_interval_sweep():
            log_scale = "log" in value.tags
            bounded(value.start, value.end, log_scale)
            if "int" in value.tags or (isinstance(value.start, int)
                                       and isinstance(value.end, int)):
                return IntDistribution(int(value.start), int(value.end), log=log_scale)
            return FloatDistribution(value.start, value.end, log=log_scale)
    except ValueError as err:  # Optuna's own checks (a step that does not fit, ...)
        raise SweepError(f"hydra.sweeper.params: {line}: {err}") from err
    raise SweepError(f"hydra.sweeper.params: {line}: not a search space Optuna can sample: "
                     f"use choice(...), range(...) or interval(...)")


def grid_values(key: str, space: BaseDistribution) -> List[Any]:
    """A distribution's points on a grid, as hydra-optuna-sweeper lays them out (a range's
    end is left out, as Hydra's `range` leaves it out)."""
    if isinstance(space, CategoricalDistribution):
        return list(space.choices)
    if isinstance(space, (IntDistribution, FloatDistribution)) and space.step is not None:
        count = int((space.high - space.low) // space.step)
        return [space.low + i * space.step for i in range(count)]
    raise SweepError(f"hydra.sweeper.params: {key}: the grid sampler needs choice(...) or "
                     f"range(...), not a continuous interval")


def check_sqlite(storage: str) -> None:
    """Refuse an sqlite file that is not an Optuna study's before Optuna opens it (Optuna's
    own errors blame the Optuna version, or print a traceback)."""
    path = Path(storage[len("sqlite:///"):])
    if not path.is_file() or path.stat().st_size == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        return
    try:
        with closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=5)) as db:
            tables = {row[0] for row in db.execute(
                "SELECT name FROM sqlite_master WHERE type = 'table'")}
    except sqlite3.OperationalError as err:
        if "locked" in str(err):
            raise SweepError(f"hydra.sweeper.storage={storage}: the database is locked by "
                             f"another process: let it finish, or give this sweep a storage "
                             f"of its own") from err
        raise SweepError(f"hydra.sweeper.storage={storage}: cannot read it ({err})") from err
    except sqlite3.DatabaseError as err:
        raise SweepError(f"hydra.sweeper.storage={storage}: not an sqlite database, or a "
                         f"corrupt one ({err}): move it away, or point storage at a new "
                         f"file") from err
    if tables and "studies" not in tables:
        owner = ("MLflow's tracking store" if {"experiments", "runs"} <= tables else
                 "another program's database")
        raise SweepError(f"hydra.sweeper.storage={storage}: this file is {owner}, not an "
                         f"Optuna study: give the study its own file, e.g. "
                         f"sqlite:///{path.parent / 'optuna.db'}")


def open_storage(storage: Optional[Any]) -> Any:
    """None (in memory), an RDB URL, or a journal file (any path without `://`)."""
    if storage is None or not isinstance(storage, str):
        return storage
    if "://" in storage:
        if storage.startswith("sqlite:///"):
            check_sqlite(storage)
        return storage
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    Path(storage).parent.mkdir(parents=True, exist_ok=True)
    return JournalStorage(JournalFileBackend(storage))


@contextmanager
def storage_errors(storage: Any) -> Iterator[None]:
    """Opening the study: what goes wrong (a database, a driver, a journal, a study of other
    directions) said in one line."""
    where = f"hydra.sweeper.storage={strip_credentials(str(storage))}"
    try:
        yield
    except ImportError as err:  # the database's driver (Optuna re-raises it as its own)
        missing = getattr(err.__cause__, "name", None) or getattr(err, "name", None)
        raise SweepError(f"{where}: the driver for this database is not installed (no module "
                         f"{missing!r}): install it, or use sqlite:///PATH or a journal file "
                         f"path") from err
    except SweepError:
        raise
    except Exception as err:  # a database that is not one, a journal that is not JSON, ...
        raise SweepError(f"{where}: {one_line(err, named=False)}") from err


def directions_of(direction: Any) -> List[str]:
    items = list(direction) if isinstance(direction, (list, tuple, ListConfig)) else [direction]
    names = [item.name if hasattr(item, "name") else str(item) for item in items]
    bad = [name for name in names if name not in ("minimize", "maximize")]
    if not names or bad:
        raise SweepError(f"hydra.sweeper.direction={direction}: each must be minimize or "
                         f"maximize (a list of them for several objectives)")
    return names


def derived_seed(seed: int, trials_so_far: int) -> int:
    """The seed for a study that already holds trials: the seed alone would make a seeded
    sampler propose the first trials' parameters once more."""
    return random.Random(f"{seed}:{trials_so_far}").randrange(2**32)


class OptunaSweeperImpl:
    def __init__(self, sampler: DictConfig, direction: Any, storage: Optional[Any],
                 study_name: Optional[str], n_trials: int, n_jobs: int,
                 max_failure_rate: float, params: Optional[DictConfig],
                 custom_search_space: Optional[str], seed: Optional[int]) -> None:
        self.sampler_config, self.direction = sampler, direction
        self.storage, self.study_name = storage, study_name
        self.n_trials, self.n_jobs = n_trials, n_jobs
        self.max_failure_rate, self.seed = max_failure_rate, seed
        self.params = dict(params or {})
        self.custom_search_space = custom_search_space
        self.config: Optional[DictConfig] = None
        self.hydra_context: Optional[HydraContext] = None
        self.launcher: Any = None
        self.job_idx = 0

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction,
              config: DictConfig) -> None:
        self.config, self.hydra_context, self.job_idx = config, hydra_context, 0
        self.launcher = Plugins.instance().instantiate_launcher(
            hydra_context=hydra_context, task_function=GuardedTask(task_function),
            config=config)

    def validate_batch_is_legal(self, batch: Sequence[Sequence[str]]) -> None:
        """Compose each job's config here first: a bad override fails before it launches."""
        assert self.config is not None and self.hydra_context is not None
        for overrides in batch:
            self.hydra_context.config_loader.load_sweep_config(
                master_config=self.config, sweep_overrides=list(overrides))

    def check(self) -> Tuple[List[str], Optional[Callable[[DictConfig, Trial], None]]]:
        if self.n_trials < 1 or self.n_jobs < 1:
            raise SweepError(f"hydra.sweeper.n_trials={self.n_trials}, n_jobs={self.n_jobs}: "
                             f"both must be at least 1")
        if not 0.0 <= self.max_failure_rate <= 1.0:
            raise SweepError(f"hydra.sweeper.max_failure_rate={self.max_failure_rate}: it must "
                             f"be between 0.0 (no failure) and 1.0 (any number)")
        extend = None
        if self.custom_search_space:
            try:
                extend = get_method(self.custom_search_space)
            except Exception as err:  # Hydra's lookup: an import error, a missing name
                raise SweepError(f"hydra.sweeper.custom_search_space="
                                 f"{self.custom_search_space}: "
                                 f"{one_line(err, named=False)}") from err
        return directions_of(self.direction), extend

    def sweep(self, arguments: List[str]) -> List[Sequence[JobReturn]]:
        assert self.config is not None and self.launcher is not None
        directions, extend = self.check()
        space, fixed = self.search_space(arguments)
        with storage_errors(self.storage):
            study = optuna.create_study(
                study_name=self.study_name, storage=open_storage(self.storage),
                sampler=optuna.samplers.RandomSampler(), directions=directions,
                load_if_exists=True)
        kept = [d.name.lower() for d in study.directions]
        if kept != directions:  # Optuna would go on in the stored directions, silently
            raise SweepError(f"hydra.sweeper.direction={directions}: study {study.study_name} "
                             f"in {strip_credentials(str(self.storage))} optimizes {kept}: give "
                             f"this sweep another study_name, or its storage")
        try:
            study.sampler, n_trials = self.sampler_for(study, space)
        except SweepError:
            raise
        except Exception as err:  # the sampler's own checks of its options
            raise SweepError(f"hydra.sweeper.sampler: {one_line(err, named=False)}") from err
        log.info("Optuna study %s (%s, %d trials so far), %s sampler: %d trials over %s",
                 study.study_name, strip_credentials(str(self.storage or "in memory")),
                 len(study.trials),
                 type(study.sampler).__name__, n_trials,
                 ", ".join(f"{key} {dist}" for key, dist in space.items()) or "no parameter")
        sweep_dir = Path(self.config.hydra.sweep.dir)
        sweep_dir.mkdir(parents=True, exist_ok=True)
        OmegaConf.save(self.config, sweep_dir / "multirun.yaml")
        returns: List[Sequence[JobReturn]] = []
        ended = 0
        while ended < n_trials:
            trials: List[Trial] = []
            try:
                for _ in range(min(self.n_jobs, n_trials - ended)):
                    trials.append(study.ask(space))
                batch = [self.overrides_of(trial, space, fixed, extend) for trial in trials]
                if not returns:  # later batches only differ in the values of the same keys
                    self.validate_batch_is_legal(batch)
                results = self.launcher.launch(batch, initial_job_idx=self.job_idx)
                for trial, result in zip(list(trials), results):
                    self.tell(study, trial, result, len(directions))
                    trials.remove(trial)  # told: no longer the sweep's to fail
            except BaseException as stop:  # an error, Ctrl-C, an interrupted job
                self.fail(study, trials, retry=not isinstance(stop, Exception))
                raise
            self.job_idx += len(results)
            returns.append(results)
            ended += len(results)
            # A job that returned no number fails its trial, yet the job itself did not fail.
            failed = [result for result in results if result.status == JobStatus.FAILED]
            if failed and len(failed) / len(results) > self.max_failure_rate:
                log.error("%d of the %d trials of this batch failed, more than "
                          "hydra.sweeper.max_failure_rate=%s: the sweep ends", len(failed),
                          len(results), self.max_failure_rate)
                self.report(study, sweep_dir)
                end_with(failed[0])
        self.report(study, sweep_dir)
        finished = [r for batch in returns for r in batch]
        if all(r.status == JobStatus.FAILED for r in finished):
            log.error("all %d jobs of this sweep failed", len(finished))
            end_with(finished[0])
        return returns

    def search_space(self, arguments: List[str]) -> Tuple[Dict[str, BaseDistribution],
                                                          List[str]]:
        """The distributions to sample, and the overrides every trial gets as they are; the
        command line wins over `params`, key by key."""
        assert self.hydra_context is not None
        parser = OverridesParser.create(config_loader=self.hydra_context.config_loader)
        overrides = {o.get_key_element(): o for o in parser.parse_overrides(
            [f"{key}={value}" for key, value in self.params.items()] + list(arguments))}
        space = {key: distribution(o) for key, o in overrides.items() if o.is_sweep_override()}
        fixed = [o.input_line for o in overrides.values()
                 if not o.is_sweep_override() and o.input_line is not None]
        return space, fixed

    def sampler_for(self, study: optuna.Study,
                    space: Dict[str, BaseDistribution]) -> Tuple[Any, int]:
        """The configured sampler, and how many trials this sweep runs (a grid's size caps
        them)."""
        config = OmegaConf.to_container(self.sampler_config, resolve=True)
        assert isinstance(config, dict)
        config.pop("_partial_", None)  # hydra-optuna-sweeper's grid config has one
        seed = config.get("seed")
        seed = self.seed if seed is None else seed
        target = get_object(config["_target_"])
        if isinstance(target, type) and issubclass(target, optuna.samplers.GridSampler):
            grid = {key: grid_values(key, dist) for key, dist in space.items()}
            size = math.prod(len(values) for values in grid.values())
            if size < self.n_trials:
                log.info("the grid has %d points: %d trials instead of %d", size, size,
                         self.n_trials)
            return instantiate({**config, "seed": seed}, search_space=grid), min(size,
                                                                                  self.n_trials)
        if "seed" in config:
            config["seed"] = (derived_seed(seed, len(study.trials))
                              if seed is not None and study.trials else seed)
        return instantiate(config), self.n_trials

    def overrides_of(self, trial: Trial, space: Dict[str, BaseDistribution],
                     fixed: List[str],
                     extend: Optional[Callable[[DictConfig, Trial], None]]) -> List[str]:
        """The job's overrides: the trial's parameters (the search space's first, in its
        order), then the fixed overrides."""
        if extend is not None:
            extend(self.config, trial)
        fixed_keys = {line.split("=", 1)[0] for line in fixed}
        overlap = sorted(fixed_keys & set(trial.params))
        if overlap:
            raise SweepError(f"hydra.sweeper.custom_search_space suggests {', '.join(overlap)}, "
                             f"which the sweep also fixes: drop one of them")
        keys = list(space) + [key for key in trial.params if key not in space]
        overrides = [as_override(key, trial.params[key]) for key in keys] + fixed
        for line in fixed:  # as hydra-optuna-sweeper records them, credentials out
            key, _, value = line.partition("=")
            trial.set_user_attr(key, strip_credentials(value))
        trial.set_user_attr("overrides", [strip_credentials(o) for o in overrides])
        return overrides

    def tell(self, study: optuna.Study, trial: Trial, result: JobReturn,
             n_objectives: int) -> None:
        """Tell Optuna the job's value(s), or fail its trial."""
        try:
            values = values_of(result, n_objectives)
        except Exception as err:  # the job's own error, or no value
            log.warning("trial %d failed: %s", trial.number, err)
            tell(study, trial, state=TrialState.FAIL)
            return
        tell(study, trial, values=values)

    def fail(self, study: optuna.Study, trials: List[Trial], retry: bool) -> None:
        """Fail the trials a stopped sweep had asked for and not told yet; an interrupted one
        (`retry`) is asked for again first when the sweep runs again, so its job resumes
        rather than restarts."""
        grid = isinstance(study.sampler, optuna.samplers.GridSampler)
        for trial in trials:
            tell(study, trial, state=TrialState.FAIL)
            if retry and not grid and trial.params:
                study.enqueue_trial(trial.params, user_attrs={"retry_of": trial.number})
        if trials:
            log.warning("trial(s) %s failed: the sweep stopped%s",
                        ", ".join(str(t.number) for t in trials),
                        ": the same command resumes them" if retry and not grid else "")

    def single_run(self, overrides: List[str]) -> List[str]:
        """The overrides that run a trial's job again on its own (no `-m`): the job's, but for
        a config group option that sets up the sweep (such as `+hparams_search=optuna`)."""
        parser = OverridesParser.create()
        return [line for line in overrides
                if not self.sets_up_sweep(parser.parse_overrides([line])[0])]

    def sets_up_sweep(self, override: Override) -> bool:
        """Whether a config group option configures Hydra's sweep (its mode, its sweeper)."""
        assert self.hydra_context is not None
        repository = getattr(self.hydra_context.config_loader, "repository", None)
        group = override.key_or_group
        if repository is None or not repository.group_exists(group):
            return False
        try:
            found = repository.load_config(f"{group}/{override.value()}")
        except Exception:  # not a config of that group: it cannot set up the sweep
            return False
        if found is None:
            return False
        hydra = (found.config or {}).get("hydra") or {}
        defaults = getattr(found, "defaults_list", None) or []
        return ("mode" in hydra or "sweeper" in hydra
                or any(str(getattr(d, "group", "")).lstrip("/").startswith("hydra/sweeper")
                       for d in defaults))

    def report(self, study: optuna.Study, sweep_dir: Path) -> None:
        """The best trial of the whole study (several objectives: its Pareto front) to the
        log and to optimization_results.yaml."""
        complete = [t for t in study.trials if t.state == TrialState.COMPLETE]
        if not complete:
            log.warning("Optuna study %s has no complete trial yet", study.study_name)
            return
        if len(study.directions) == 1:
            best = study.best_trial
            log.info("best of %d trials: %s with %s", len(complete), best.value,
                     " ".join(f"{k}={v}" for k, v in best.params.items()))
            results: Dict[str, Any] = {
                "name": "optuna", "best_params": best.params, "best_value": best.value,
                "best_overrides": self.single_run(best.user_attrs.get("overrides", []))}
        else:
            front = study.best_trials
            log.info("%d Pareto-optimal trials of %d", len(front), len(complete))
            results = {"name": "optuna", "solutions": [
                {"params": t.params, "values": t.values,
                 "overrides": self.single_run(t.user_attrs.get("overrides", []))}
                for t in front]}
        OmegaConf.save(OmegaConf.create(results), sweep_dir / "optimization_results.yaml")


def as_override(key: str, value: Any) -> str:
    """`key=value` in the override grammar: a string as it is where Hydra reads it back as
    that string, else quoted (`'1'`, `'true'`, `'a,b'` stay strings)."""
    text = Transformer.str(value)
    if isinstance(value, str) and not reads_back(key, text, value):
        # In a quoted string only backslashes before a quote, or at its end, are escapes.
        text = "'" + re.sub(r"(\\*)('|$)", lambda m: m.group(1) * 2 + ("\\'" if m.group(2)
                                                                        else ""), value) + "'"
        if not reads_back(key, text, value):
            raise SweepError(f"{key}: the value {value!r} cannot be written as an override")
    return f"{key}={text}"


def reads_back(key: str, text: str, value: str) -> bool:
    try:
        back = OverridesParser.create().parse_overrides([f"{key}={text}"])[0]
    except Exception:  # Hydra's parse error: not as it is, then
        return False
    return not back.is_sweep_override() and isinstance(back.value(), str) and \
        back.value() == value


def tell(study: optuna.Study, trial: Trial, **told: Any) -> None:
    try:
        study.tell(trial, **told)
    except RuntimeError as err:  # a grid sampler stops the study once it is complete
        if "Study.stop" not in str(err):
            raise


def values_of(result: JobReturn, n_objectives: int) -> List[float]:
    """The job's value(s) as floats, or the reason it has none (its own error, raised)."""
    if result.status == JobStatus.FAILED:
        # Not through `return_value`, which prints the job's overrides verbatim (a password
        # in a URL included)
        raise result._return_value
    returned = result._return_value
    many = n_objectives > 1
    if many and not isinstance(returned, (list, tuple, ListConfig)):
        raise ValueError(f"the job returned {returned!r}: a sweep of {n_objectives} "
                         f"objectives needs a list of {n_objectives} numbers")
    try:
        values = [float(v) for v in (returned if many else [returned])]
    except (TypeError, ValueError):
        raise ValueError(f"the job returned {returned!r}, not a number") from None
    if len(values) != n_objectives:
        raise ValueError(f"the job returned {len(values)} values for {n_objectives} objectives")
    if not all(math.isfinite(v) for v in values):
        raise ValueError(f"the job returned {returned!r}")
    return values


def end_with(failed: JobReturn) -> None:
    """End the sweep as a failed job ended: with its exit code, or its exception."""
    error = failed._return_value
    if isinstance(error, JobExit):
        raise SystemExit(error.code)
    raise error


"""The config of `hydra/sweeper=goodput_optuna`: hydra-optuna-sweeper 1.3's keys and defaults
(the sampler in the `hydra/sweeper/sampler` group), plus ours: a journal-file `storage` and a
fallback `seed`. Each sampler's options default to current Optuna's own defaults.

Imported by Hydra's plugin scan in every Hydra app of the environment, so nothing here
imports Optuna.
"""

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

# No `from __future__ import annotations` in this module: Hydra's plugin scan runs it outside
# sys.modules, where dataclasses cannot resolve string annotations.

_IMPL = "hydra_plugins.goodput_optuna_sweeper._impl"


@dataclass
class SamplerConfig:
    _target_: str = MISSING
    seed: Optional[int] = None


@dataclass
class TPESamplerConfig(SamplerConfig):
    _target_: str = "optuna.samplers.TPESampler"
    consider_prior: Optional[bool] = None
    prior_weight: Optional[float] = None
    consider_magic_clip: Optional[bool] = None
    consider_endpoints: Optional[bool] = None
    n_startup_trials: int = 10
    n_ei_candidates: int = 24
    multivariate: bool = False
    warn_independent_sampling: Optional[bool] = None


@dataclass
class RandomSamplerConfig(SamplerConfig):
    _target_: str = "optuna.samplers.RandomSampler"


@dataclass
class CmaEsSamplerConfig(SamplerConfig):
    _target_: str = "optuna.samplers.CmaEsSampler"
    x0: Optional[Dict[str, Any]] = None
    sigma0: Optional[float] = None
    n_startup_trials: int = 1
    warn_independent_sampling: bool = True
    consider_pruned_trials: bool = False
    popsize: Optional[int] = None
    use_separable_cma: bool = False
    with_margin: bool = False
    lr_adapt: bool = False


@dataclass
class NSGAIISamplerConfig(SamplerConfig):
    _target_: str = "optuna.samplers.NSGAIISampler"
    population_size: int = 50
    mutation_prob: Optional[float] = None
    crossover_prob: float = 0.9
    swapping_prob: float = 0.5


@dataclass
class MOTPESamplerConfig(SamplerConfig):
    """Optuna 4 folded MOTPE into TPE, which handles several objectives itself."""

    _target_: str = f"{_IMPL}.motpe_sampler"
    consider_prior: Optional[bool] = None
    prior_weight: Optional[float] = None
    consider_magic_clip: Optional[bool] = None
    consider_endpoints: Optional[bool] = None
    n_startup_trials: int = 10
    n_ehvi_candidates: int = 24


@dataclass
class GridSamplerConfig(SamplerConfig):
    """The grid is the search space (`params`); seed null: the grid in the order of Hydra's
    basic sweeper, a seed: shuffled by it, as Optuna's own grid sampler does."""

    _target_: str = f"{_IMPL}.GridSampler"


@dataclass
class OptunaSweeperConf:
    _target_: str = "hydra_plugins.goodput_optuna_sweeper.optuna_sweeper.OptunaSweeper"
    defaults: List[Any] = field(default_factory=lambda: [{"sampler": "tpe"}])
    # The sampler arrives as its config: it is built once the study is open (a resumed
    # study reseeds it, a grid needs the search space).
    _recursive_: bool = False
    sampler: SamplerConfig = MISSING
    # minimize or maximize the value each job returns, or a list of them for a job that
    # returns several values (its Pareto front goes to optimization_results.yaml)
    direction: Any = "minimize"
    # Where the study persists, so the same sweep again continues it: an RDB URL
    # (sqlite:///optuna.db; never MLflow's own database) or a journal file path (no `://`).
    # null: in memory.
    storage: Optional[Any] = None
    study_name: Optional[str] = None  # null: Optuna names a new study
    n_trials: int = 20  # trials this sweep adds to the study
    n_jobs: int = 2  # trials asked for and launched at once (one batch)
    # The share of a batch's trials that may fail before the sweep ends (0.0: any failure)
    max_failure_rate: float = 0.0
    # key: search space in Hydra's override grammar (hydra-optuna-sweeper's)
    params: Optional[Dict[str, str]] = None
    # A dotted path to `fn(cfg, trial)` that suggests more parameters on each trial
    custom_search_space: Optional[str] = None
    seed: Optional[int] = None  # the sampler's seed where sampler.seed is null (ours)


ConfigStore.instance().store(group="hydra/sweeper", name="goodput_optuna",
                             node=OptunaSweeperConf, provider="goodput-trainer")
for _name, _node in [("tpe", TPESamplerConfig), ("random", RandomSamplerConfig),
                     ("cmaes", CmaEsSamplerConfig), ("nsgaii", NSGAIISamplerConfig),
                     ("motpe", MOTPESamplerConfig), ("grid", GridSamplerConfig)]:
    ConfigStore.instance().store(group="hydra/sweeper/sampler", name=_name, node=_node,
                                 provider="goodput-trainer")

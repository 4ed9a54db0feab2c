"""A sweep as one MLflow parent run with a child run per job, whatever the sweeper
(basic, goodput_optuna) and the launcher (basic, joblib, submitit).

Hydra calls `SweepRun` (a callback, conf/logger/mlflow.yaml) in the process that runs the
sweep: once before the first job starts, once after the last one returned. It creates the
parent there and hands its id to the jobs in PARENT_ENV, which every launcher passes on:
the basic launcher's jobs share the process, joblib's workers and submitit's local
processes inherit the environment, and sbatch exports it to SLURM jobs by default.

Why not a parent that the jobs find or create under a file lock: a lock on the shared
file system that SLURM jobs see is not to be trusted; one creation in one process needs
none. The parent is named by the sweep's id (`sweep-<id>`, train/tracking/sweep_record.py) and
tagged with its record's directory (`sweep.record`). Each job names the parent when its run starts (train/tracking/tracker.py)
and, when it ends, records the best objective so far on the parent (`best/<objective>`, its step the
number of jobs compared, so a stale write never hides a newer one); after the last job the
callback records it once more and ends the parent.

Only mlflow and Hydra are imported here: this runs in the sweep's own process, which has no
use for torch.
"""

from __future__ import annotations

import logging
import os
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional

from filelock import FileLock, Timeout
from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from common.redact import one_line, strip_credentials

log = logging.getLogger(__name__)
PARENT_ENV = "GOODPUT_SWEEP_PARENT_RUN_ID"
# Marks the experiment for model development: without it MLflow 3's UI opens in its GenAI
# mode (traces, "Evaluation runs"). The values are MLflow's ExperimentKind
# (mlflow/server/js, 3.x): genai_development, custom_model_development, ...
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
MODEL_DEVELOPMENT = "custom_model_development"
PARENT_TAG = "mlflow.parentRunId"
# A store that does not answer in a few seconds is a configuration problem (the start check
# of a run, the creation of a sweep's parent), not a reason to wait out MLflow's retries.
CHECK_HTTP_SETTINGS = {"MLFLOW_HTTP_REQUEST_TIMEOUT": "5", "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0"}


@dataclass
class SweepJob:
    """This process's job of a sweep: the parent run and what tells the job apart."""

    parent_run_id: str
    number: int
    overrides: List[str]

    def tags(self) -> Dict[str, str]:
        return {PARENT_TAG: self.parent_run_id, "sweep.id": self.parent_run_id,
                "sweep.job": str(self.number),
                "sweep.overrides": strip_credentials(" ".join(self.overrides))}


def current_sweep_job() -> Optional[SweepJob]:
    """The sweep job this process runs, if it runs one under a parent run."""
    parent = os.environ.get(PARENT_ENV)
    if not parent or not HydraConfig.initialized():
        return None
    hydra = HydraConfig.get()
    if hydra.mode != RunMode.MULTIRUN:
        return None
    return SweepJob(parent, int(hydra.job.num), list(hydra.overrides.task))


class SweepRun(Callback):
    """The sweep's parent run: created before the first job, ended after the last."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        # One left in the shell (an export, an outer sweep) is not this sweep's parent.
        os.environ.pop(PARENT_ENV, None)
        if value_of(OmegaConf.select(config, "logger.name")) != "mlflow":
            return
        try:
            with environment(CHECK_HTTP_SETTINGS):
                os.environ[PARENT_ENV] = create_parent_run(config)
        except Exception as err:  # the sweep must not fail for its tracking
            log.warning("MLflow: no parent run for this sweep (%s): each job logs a run of "
                        "its own", one_line(err))

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        parent = os.environ.pop(PARENT_ENV, None)
        if parent is None:
            return
        try:
            with environment(CHECK_HTTP_SETTINGS):  # a store that died mid-sweep: seconds
                client = mlflow_client(config.logger.tracking_uri)
                record_best(client, parent, config.sweep.objective,
                            value_of(config.sweep.direction))
                client.set_terminated(parent, "FINISHED")
        except Exception as err:
            log.warning("MLflow: the sweep's parent run %s was not completed (%s)", parent,
                        one_line(err))


def create_parent_run(config: DictConfig) -> str:
    """The parent run of the sweep `config` describes; returns its id."""
    client = mlflow_client(config.logger.tracking_uri)
    experiment_id = open_experiment(client, config.logger.experiment_name)
    overrides = OmegaConf.select(config, "hydra.overrides.task", default=[]) or []
    tags = {"sweep.overrides": strip_credentials(" ".join(overrides)),
            "sweep.objective": str(config.sweep.objective),
            "sweep.direction": value_of(config.sweep.direction),
            "sweep.sweeper": str(OmegaConf.select(config, "hydra.sweeper._target_")),
            "sweep.launcher": str(OmegaConf.select(config, "hydra.launcher._target_"))}
    from train.tracking.sweep_record import record_dir, sweep_id_of  # it imports this module

    record = record_dir(config)
    if record is not None:
        tags["sweep.record"] = strip_credentials(str(record))
    run = client.create_run(experiment_id, run_name=f"sweep-{sweep_id_of(config)}", tags=tags)
    client.set_tag(run.info.run_id, "sweep.id", run.info.run_id)
    log.info("MLflow: sweep parent run %s (%s)", run.info.run_name, run.info.run_id)
    return run.info.run_id


def parent_problem(client: Any, parent_run_id: str, experiment_id: str) -> Optional[str]:
    """Why `parent_run_id` cannot be the parent of a run of `experiment_id`, or None."""
    try:
        parent = client.get_run(parent_run_id)
    except Exception as err:  # garbage, or no such run: MLflow says which
        return one_line(err)
    if parent.info.experiment_id != experiment_id:
        return (f"it is a run of experiment {parent.info.experiment_id}, not of this run's "
                f"({experiment_id})")
    if parent.info.lifecycle_stage != "active":
        return "it was deleted"
    return None


def record_best(client: Any, parent_run_id: str, objective: str, direction: str) -> None:
    """The best `objective` among the parent's children so far, and which job it was."""
    parent = client.get_run(parent_run_id)
    children = client.search_runs([parent.info.experiment_id],
                                  filter_string=f"tags.`{PARENT_TAG}` = '{parent_run_id}'",
                                  max_results=10_000)
    scored = sorted((run for run in children if objective in run.data.metrics),
                    key=lambda run: int(run.data.tags.get("sweep.job", 0)))  # ties: first job
    if not scored:
        return
    pick = max if direction == "maximize" else min
    best = pick(scored, key=lambda run: run.data.metrics[objective])
    client.log_metric(parent_run_id, f"best/{objective}", best.data.metrics[objective],
                      step=len(scored))
    client.set_tag(parent_run_id, "best.job", best.data.tags.get("sweep.job", ""))
    client.set_tag(parent_run_id, "best.run_name", best.info.run_name or "")
    client.set_tag(parent_run_id, "best.run_id", best.info.run_id)


def open_experiment(client: Any, name: str) -> str:
    """The experiment's id, created if need be, and marked for model development."""
    with sqlite_creation_lock(client.tracking_uri):
        experiment = client.get_experiment_by_name(name)
        experiment_id = (experiment.experiment_id if experiment
                         else client.create_experiment(name))
    client.set_experiment_tag(experiment_id, EXPERIMENT_KIND_TAG, MODEL_DEVELOPMENT)
    return experiment_id


def mlflow_client(tracking_uri: Optional[str]) -> Any:
    """A client of `tracking_uri`, or of MLflow's default store (None); MLflow's global
    tracking URI stays as it was (the basic launcher's jobs share this process). Making one
    opens the store, which creates a new sqlite store: under its lock, or two sweeps started
    at once both migrate its schema and one fails ("duplicate column name: step")."""
    import mlflow  # slow to import: only when MLflow is used

    uri = tracking_uri or mlflow.get_tracking_uri()
    with sqlite_creation_lock(uri):
        return mlflow.MlflowClient(tracking_uri=uri)


@contextmanager
def environment(settings: Dict[str, str]) -> Iterator[None]:
    """`settings` in os.environ for the block, whatever it held; restored after."""
    saved = {name: os.environ.get(name) for name in settings}
    os.environ.update(settings)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@contextmanager
def sqlite_creation_lock(uri: str, timeout_s: float = 300.0) -> Iterator[None]:
    """Hold `<db>.lock` while a sqlite store may be created: parallel sweep jobs (joblib,
    submitit) that open a new store at once both run its schema migrations and leave it
    half-built ("table _alembic_tmp_metrics already exists"). The kernel drops the lock of
    a process that dies. Other stores need nothing."""
    path = uri[len("sqlite:///"):].split("?")[0] if uri.startswith("sqlite:///") else ""
    if not path:
        yield
        return
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    try:
        with FileLock(f"{path}.lock", timeout=timeout_s):
            yield
    except Timeout:
        raise RuntimeError(f"{path}.lock stayed locked for {timeout_s:.0f}s: another run is "
                           f"still creating the store") from None


def value_of(choice: Any) -> str:
    """An Enum's value (a structured config's choice), or the plain value, as a string."""
    return str(getattr(choice, "value", choice))

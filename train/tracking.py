"""Experiment tracking: MLflow from rank 0, or nothing (`logger=none`)."""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from contextlib import contextmanager
from itertools import islice
from pathlib import Path
from typing import Any, Callable, Deque, Dict, Iterator, List, Optional

import torch
from omegaconf import DictConfig, OmegaConf

from common.distributed import broadcast_object
from data.redact import hide_storage_secrets, strip_credentials
from train.config import LoggerConfig, LoggerName
from train.distributed import World
from train.errors import ConfigError
from train.preemption import Preempted
from train.sweep_tracking import (CHECK_HTTP_SETTINGS, EXPERIMENT_KIND_TAG, MODEL_DEVELOPMENT,
                                  PARENT_ENV, SweepJob, current_sweep_job, environment,
                                  one_line, parent_problem, record_best, sqlite_creation_lock,
                                  value_of)

log = logging.getLogger(__name__)
MAX_PARAMS_PER_CALL = 100  # MLflow's batch limit for params
MAX_METRICS_PER_CALL = 1000  # and for metrics
MAX_PENDING_METRICS = 100_000  # held while the store is down: ~20 MB
RETRY_SECONDS = 30  # between attempts to reach a failed store (each may block a step)
RUN_HTTP_SETTINGS = {"MLFLOW_HTTP_REQUEST_TIMEOUT": "10", "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1"}
GOODPUT_IN_GROUP = "goodput/fraction"  # `goodput` again, drawn among the goodput/* charts


def flatten(tree: Any, prefix: str = "", text: Callable[[Any], str] = str) -> Dict[str, str]:
    """{'optim': {'lr': 0.1}} -> {'optim.lr': '0.1'}: the resolved config as MLflow params
    and as a checkpoint's record of its config, so URL credentials are stripped here."""
    if isinstance(tree, dict):
        out: Dict[str, str] = {}
        for key, value in tree.items():
            out.update(flatten(value, f"{prefix}{key}.", text))
        return out
    return {prefix[:-1]: strip_credentials(text(tree))}


def param_text(value: Any) -> str:
    """A config value as it is typed on the command line, so a search for
    `params.optim.name = 'adamw'` or `params.data.cache_dir = 'null'` finds it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    return value_of(value)


def mlflow_params(config: DictConfig) -> Dict[str, str]:
    """The resolved config as MLflow params: enums by value, nulls as 'null'. (A
    checkpoint's record of its config keeps `flatten`'s plain spelling: resumes compare it.)"""
    return flatten(hide_storage_secrets(OmegaConf.to_container(config, resolve=True)),
                   text=param_text)


def parameter_counts(model: torch.nn.Module) -> Dict[str, str]:
    """Total and trainable parameters (global counts: an FSDP shard reports its full size)."""
    params = list(model.parameters())
    return {"model.parameters": str(sum(p.numel() for p in params)),
            "model.trainable_parameters": str(sum(p.numel() for p in params
                                                  if p.requires_grad))}


class NullTracker:
    """Logs nothing: `logger=none`, and every rank but 0."""

    @contextmanager
    def run(self, run_name: str, config: DictConfig,
            resume_run_id: Optional[str] = None) -> Iterator[Optional[str]]:
        yield resume_run_id

    def check(self) -> Optional[str]:
        return None

    def log_metrics(self, metrics: Dict[str, float], step: int) -> None:
        pass

    def log_artifact(self, path: Path) -> None:
        pass

    def log_files(self, paths: List[Path]) -> None:
        pass

    def log_params(self, params: Dict[str, str]) -> None:
        pass

    def log_model(self, model: torch.nn.Module, example: torch.Tensor,
                  metadata: Dict[str, Any]) -> None:
        pass


class MLflowTracker:
    """Rank 0's MLflow run. A store that fails mid-run never stops training: metrics wait
    in memory (up to MAX_PENDING_METRICS values) and are sent when the store answers again."""

    def __init__(self, cfg: LoggerConfig) -> None:
        import mlflow  # slow to import: only when MLflow is used

        self.mlflow = mlflow
        self.cfg = cfg
        if cfg.tracking_uri:
            mlflow.set_tracking_uri(cfg.tracking_uri)
        self.experiment_name = cfg.experiment_name
        self.uri = strip_credentials(mlflow.get_tracking_uri())
        self.client: Any = None  # made once the store is known to open (check or run)
        self.run_id: Optional[str] = None
        self.sweep: Optional[SweepJob] = None  # set when the run starts under a live parent
        self.pending: Deque[Any] = deque()  # mlflow.entities.Metric, oldest first
        self.dropped = 0
        self.retry_at: Optional[float] = None  # set while the store is failing
        # MLflow retries a failed HTTP request for ~4 minutes by default, blocking the step;
        # with metrics buffered here a short attempt is enough. The user's settings win.
        for name, value in RUN_HTTP_SETTINGS.items():
            os.environ.setdefault(name, value)

    def check(self) -> Optional[str]:
        """None when the store answers and takes a write (a tag on the experiment), else one
        line saying why not; bounded by CHECK_HTTP_SETTINGS, whatever the environment says."""
        try:
            with environment(CHECK_HTTP_SETTINGS):
                with sqlite_creation_lock(self.mlflow.get_tracking_uri()):
                    experiment = self.mlflow.set_experiment(self.experiment_name)
                client = self.mlflow.tracking.MlflowClient()
                client.set_experiment_tag(experiment.experiment_id, "goodput.last_start",
                                          time.strftime("%Y-%m-%dT%H:%M:%S%z"))
                client.set_experiment_tag(experiment.experiment_id, EXPERIMENT_KIND_TAG,
                                          MODEL_DEVELOPMENT)
            return None
        except Exception as err:  # any failure to reach or write the store means the same
            return (f"the MLflow tracking store {self.uri} cannot be used ({one_line(err)}): "
                    f"start it or make it writable, fix logger.tracking_uri, or train "
                    f"without tracking (logger=none)")

    @contextmanager
    def run(self, run_name: str, config: DictConfig,
            resume_run_id: Optional[str] = None) -> Iterator[Optional[str]]:
        """Start (or, after a resume, reopen) the MLflow run; yields its id.

        MLflow params are immutable, so a resumed run records the config it resumed with
        as tags (`resume.<key>` for each value that differs from the logged params).
        The run ends FAILED if the body raises, KILLED if it was preempted (it goes on
        when the same command runs again).
        """
        try:
            self.run_id = self._start(strip_credentials(run_name), config, resume_run_id)
        except Exception as err:  # the store failed after the start check: train anyway
            log.warning("MLflow store %s failed when starting the run (%s): training goes on "
                        "and this process logs no metrics", self.uri, one_line(err))
            self._end_half_started_run()
            yield resume_run_id
            return
        status = "FAILED"
        try:
            yield self.run_id
            status = "FINISHED"
        except Preempted:
            status = "KILLED"
            raise
        finally:
            self.log_files([Path(h.baseFilename) for h in logging.getLogger().handlers
                            if isinstance(h, logging.FileHandler)])  # the run's log
            self.flush(final=True)
            try:
                self.mlflow.end_run(status)
            except Exception as err:
                log.warning("MLflow store %s failed when ending run %s (%s): it stays "
                            "RUNNING there", self.uri, self.run_id, one_line(err))
            self._record_sweep_best(config)

    def _end_half_started_run(self) -> None:
        """A run the failed start left active would refuse the next job's start in this
        process (the basic launcher runs a sweep's jobs in one process)."""
        try:
            self.mlflow.end_run("FAILED")  # drops the active run before it tells the store
        except Exception:  # the store that failed the start: the run stays RUNNING there
            pass

    def _record_sweep_best(self, config: DictConfig) -> None:
        """The sweep's parent shows the best job so far (the sweep's end records it again)."""
        job = self.sweep
        if job is None:
            return
        try:
            record_best(self.client, job.parent_run_id,
                        OmegaConf.select(config, "sweep.objective", default="val/top1"),
                        value_of(OmegaConf.select(config, "sweep.direction",
                                                  default="maximize")))
        except Exception as err:
            log.warning("MLflow store %s failed to update the sweep's parent run %s (%s)",
                        self.uri, job.parent_run_id, one_line(err))

    def _start(self, run_name: str, config: DictConfig, resume_run_id: Optional[str]) -> str:
        mlflow = self.mlflow
        experiment = mlflow.set_experiment(self.experiment_name)
        self.client = mlflow.tracking.MlflowClient()
        params = mlflow_params(config)
        if resume_run_id and not self._exists(resume_run_id):
            log.warning("MLflow run %s is not in %s: starting a new one", resume_run_id,
                        self.uri)
            resume_run_id = None
        sweep = self.sweep = self._sweep_job(experiment.experiment_id)
        active = mlflow.start_run(run_id=resume_run_id,
                                  run_name=None if resume_run_id else run_name,
                                  log_system_metrics=self.cfg.system_metrics)
        if sweep:  # a resumed job moves to the sweep that finishes it
            mlflow.set_tags(sweep.tags())
        log.info("MLflow run %s (%s) at %s", run_name, active.info.run_id, self.uri)
        if resume_run_id:
            logged = active.data.params
            changed = {f"resume.{k}": v for k, v in params.items() if logged.get(k) != v}
            mlflow.set_tags({"resumed": "true", **changed})
        else:
            items = sorted(params.items())
            for i in range(0, len(items), MAX_PARAMS_PER_CALL):
                mlflow.log_params(dict(items[i:i + MAX_PARAMS_PER_CALL]))
            shown = hide_storage_secrets(OmegaConf.to_container(config, resolve=True))
            mlflow.log_text(strip_credentials(OmegaConf.to_yaml(shown)), "config.yaml")
        return active.info.run_id

    def _sweep_job(self, experiment_id: str) -> Optional[SweepJob]:
        """This process's sweep job, if its parent is a live run of this experiment; else one
        warning, and the job logs a run of its own."""
        job = current_sweep_job()
        problem = job and parent_problem(self.client, job.parent_run_id, experiment_id)
        if not problem:
            return job
        shown = ascii(job.parent_run_id[:40]) + ("..." if len(job.parent_run_id) > 40 else "")
        log.warning("%s=%s is no parent run in %s (%s): this job logs a run of its own (only "
                    "a sweep sets it: unset it in the shell)", PARENT_ENV, shown, self.uri,
                    problem)
        return None

    def _exists(self, run_id: str) -> bool:
        try:
            self.mlflow.get_run(run_id)
            return True
        except self.mlflow.exceptions.MlflowException:
            return False

    def log_metrics(self, metrics: Dict[str, float], step: int) -> None:
        if self.run_id is None:  # the run never started: nothing to log into
            return
        if "goodput" in metrics:  # the UI groups by prefix: the headline next to its parts
            metrics = {**metrics, GOODPUT_IN_GROUP: metrics["goodput"]}
        now = int(time.time() * 1000)
        self.pending.extend(self.mlflow.entities.Metric(key, float(value), now, step)
                            for key, value in metrics.items())
        overflow = len(self.pending) - MAX_PENDING_METRICS
        for _ in range(max(overflow, 0)):
            self.pending.popleft()
        self.dropped += max(overflow, 0)
        if self.retry_at is None or time.monotonic() >= self.retry_at:
            self.flush()

    def log_artifact(self, path: Path) -> None:
        """Attach a file to the run; a store that fails only warns (it is a report)."""
        if self.run_id is None:
            return
        try:
            self.client.log_artifact(self.run_id, str(path))
        except Exception as err:
            log.warning("MLflow store %s failed to take %s (%s)", self.uri, path.name,
                        one_line(err))

    def log_files(self, paths: List[Path]) -> None:
        """Attach those of `paths` that exist (a run that failed early wrote fewer)."""
        for path in paths:
            if path.is_file():
                self.log_artifact(path)

    def log_params(self, params: Dict[str, str]) -> None:
        """More params (logged again after a resume: MLflow takes an unchanged value)."""
        if self.run_id is None:
            return
        try:
            self.mlflow.log_params(params)
        except Exception as err:
            log.warning("MLflow store %s failed to take params %s (%s)", self.uri,
                        ", ".join(params), one_line(err))

    def log_model(self, model: torch.nn.Module, example: torch.Tensor,
                  metadata: Dict[str, Any]) -> None:
        """The trained model as an MLflow model (`model`), with its signature and an input
        example, registered under `logger.registered_model_name` when set. MLflow 3 saves it
        with torch.export ("pt2"): loading runs no pickled code and needs no class of ours.
        A failure only warns: model_final.pt holds the same weights."""
        if self.run_id is None or not self.cfg.log_model:
            return
        from mlflow.models import infer_signature

        try:
            with torch.no_grad():
                output = model(example)
            self.mlflow.pytorch.log_model(
                model, name="model", signature=infer_signature(example.numpy(), output.numpy()),
                input_example=example.numpy(), metadata=metadata,
                # Given, not inferred: MLflow's inference re-imports the model in a
                # subprocess (19x slower on the tiny CNN: benchmarks/mlflow_tracking.py).
                pip_requirements=model_requirements(),
                registered_model_name=self.cfg.registered_model_name)
        except Exception as err:
            log.warning("MLflow store %s failed to take the model (%s): model_final.pt holds "
                        "the same weights", self.uri, one_line(err))

    def flush(self, final: bool = False) -> None:
        """Send what is pending; on failure keep it and try again after RETRY_SECONDS."""
        if self.run_id is None:
            return
        sent = 0
        try:
            while self.pending:
                batch = list(islice(self.pending, MAX_METRICS_PER_CALL))
                self.client.log_batch(self.run_id, metrics=batch)
                for _ in batch:
                    self.pending.popleft()
                sent += len(batch)
        except Exception as err:  # an outage of the store never stops training
            if final:
                log.warning("MLflow store %s still fails at the end of the run (%s): %d "
                            "metric values were not logged", self.uri, one_line(err),
                            len(self.pending) + self.dropped)
            elif self.retry_at is None:
                log.warning("MLflow store %s failed (%s): training goes on; metrics are kept "
                            "in memory (up to %d values, the oldest dropped beyond that) and "
                            "sent when it answers again (tried every %ds)", self.uri,
                            one_line(err), MAX_PENDING_METRICS, RETRY_SECONDS)
            self.retry_at = time.monotonic() + RETRY_SECONDS
            return
        if self.retry_at is not None:
            log.info("MLflow store %s answers again: sent %d buffered metric values (%d "
                     "dropped)", self.uri, sent, self.dropped)
            self.retry_at, self.dropped = None, 0


def build_tracker(cfg: LoggerConfig, rank: int) -> NullTracker | MLflowTracker:
    if rank != 0 or cfg.name == LoggerName.none:
        return NullTracker()
    return MLflowTracker(cfg)


def start_tracker(cfg: LoggerConfig, world: World) -> NullTracker | MLflowTracker:
    """This rank's tracker, its store checked by rank 0. Every rank gets the verdict, so a
    store that cannot be used ends all of them with one line instead of leaving the others
    waiting for rank 0 in a later collective."""
    tracker = build_tracker(cfg, world.rank)
    problem = broadcast_object(tracker.check(), world.control_group)
    if problem:
        raise ConfigError(problem)
    return tracker


def model_requirements() -> List[str]:
    """What loading the logged model needs (release versions: a local tag such as +cu130
    is no pip requirement)."""
    import torchvision

    return [f"torch=={torch.__version__.split('+')[0]}",
            f"torchvision=={torchvision.__version__.split('+')[0]}"]


def describe(metrics: Dict[str, float], keys: Optional[list[str]] = None) -> str:
    """'val/loss=0.123 val/top1=0.912' for log lines."""
    keys = keys or sorted(metrics)
    return " ".join(f"{k}={metrics[k]:.4g}" for k in keys if k in metrics)

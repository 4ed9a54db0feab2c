"""Experiment tracking: MLflow from rank 0, or nothing (`logger=none`)."""

from __future__ import annotations

import logging
from contextlib import contextmanager
from typing import Any, Dict, Iterator, Optional

from omegaconf import DictConfig, OmegaConf

from train.config import LoggerConfig, LoggerName

log = logging.getLogger(__name__)
MAX_PARAMS_PER_CALL = 100  # MLflow's batch limit for params


def flatten(tree: Any, prefix: str = "") -> Dict[str, str]:
    """{'optim': {'lr': 0.1}} -> {'optim.lr': '0.1'}: the resolved config as MLflow params."""
    if isinstance(tree, dict):
        out: Dict[str, str] = {}
        for key, value in tree.items():
            out.update(flatten(value, f"{prefix}{key}."))
        return out
    return {prefix[:-1]: str(tree)}


class NullTracker:
    """Logs nothing: `logger=none`, and every rank but 0."""

    @contextmanager
    def run(self, run_name: str, config: DictConfig,
            resume_run_id: Optional[str] = None) -> Iterator[Optional[str]]:
        yield resume_run_id

    def log_metrics(self, metrics: Dict[str, float], step: int) -> None:
        pass


class MLflowTracker:
    def __init__(self, cfg: LoggerConfig) -> None:
        import mlflow  # slow to import: only when MLflow is used

        self.mlflow = mlflow
        if cfg.tracking_uri:
            mlflow.set_tracking_uri(cfg.tracking_uri)
        self.experiment_name = cfg.experiment_name

    @contextmanager
    def run(self, run_name: str, config: DictConfig,
            resume_run_id: Optional[str] = None) -> Iterator[Optional[str]]:
        """Start (or, after a resume, reopen) the MLflow run; yields its id.

        MLflow params are immutable, so a resumed run records the config it resumed with
        as tags (`resume.<key>` for each value that differs from the logged params).
        """
        mlflow = self.mlflow
        mlflow.set_experiment(self.experiment_name)
        params = flatten(OmegaConf.to_container(config, resolve=True))
        if resume_run_id and not self._exists(resume_run_id):
            log.warning("MLflow run %s is not in %s: starting a new one", resume_run_id,
                        mlflow.get_tracking_uri())
            resume_run_id = None
        # The run ends FAILED (or KILLED) by itself if the body raises.
        with mlflow.start_run(run_id=resume_run_id,
                              run_name=None if resume_run_id else run_name) as active:
            log.info("MLflow run %s (%s) at %s", run_name, active.info.run_id,
                     mlflow.get_tracking_uri())
            if resume_run_id:
                logged = active.data.params
                changed = {f"resume.{k}": v for k, v in params.items() if logged.get(k) != v}
                mlflow.set_tags({"resumed": "true", **changed})
            else:
                items = sorted(params.items())
                for i in range(0, len(items), MAX_PARAMS_PER_CALL):
                    mlflow.log_params(dict(items[i:i + MAX_PARAMS_PER_CALL]))
                mlflow.log_text(OmegaConf.to_yaml(config, resolve=True), "config.yaml")
            yield active.info.run_id

    def _exists(self, run_id: str) -> bool:
        try:
            self.mlflow.get_run(run_id)
            return True
        except self.mlflow.exceptions.MlflowException:
            return False

    def log_metrics(self, metrics: Dict[str, float], step: int) -> None:
        self.mlflow.log_metrics(metrics, step=step)


def build_tracker(cfg: LoggerConfig, rank: int) -> NullTracker | MLflowTracker:
    if rank != 0 or cfg.name == LoggerName.none:
        return NullTracker()
    return MLflowTracker(cfg)


def describe(metrics: Dict[str, float], keys: Optional[list[str]] = None) -> str:
    """'val/loss=0.123 val/top1=0.912' for log lines."""
    keys = keys or sorted(metrics)
    return " ".join(f"{k}={metrics[k]:.4g}" for k in keys if k in metrics)

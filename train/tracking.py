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
    def run(self, run_name: str, config: DictConfig) -> Iterator[None]:
        yield

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
    def run(self, run_name: str, config: DictConfig) -> Iterator[None]:
        mlflow = self.mlflow
        mlflow.set_experiment(self.experiment_name)
        # The run ends FAILED (or KILLED) by itself if the body raises.
        with mlflow.start_run(run_name=run_name) as active:
            log.info("MLflow run %s (%s) at %s", run_name, active.info.run_id,
                     mlflow.get_tracking_uri())
            params = flatten(OmegaConf.to_container(config, resolve=True))
            items = sorted(params.items())
            for i in range(0, len(items), MAX_PARAMS_PER_CALL):
                mlflow.log_params(dict(items[i:i + MAX_PARAMS_PER_CALL]))
            mlflow.log_text(OmegaConf.to_yaml(config, resolve=True), "config.yaml")
            yield

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

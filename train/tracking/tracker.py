"""Experiment tracking: MLflow from rank 0, or nothing (`logger=none`)."""

from __future__ import annotations

import json
import logging
import os
import queue
import threading
import time
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch
from omegaconf import DictConfig, OmegaConf

from common.distributed import broadcast_object
from common.redact import hide_storage_secrets, one_line, strip_credentials
from train.config import LoggerConfig, LoggerName
from train.cluster.world import World
from train.errors import ConfigError
from train.tracking import unsent
from train.cluster.preemption import Preempted
from train.tracking.sweep_run import (CHECK_HTTP_SETTINGS, EXPERIMENT_KIND_TAG, MODEL_DEVELOPMENT,
                                      PARENT_ENV, SweepJob, current_sweep_job, environment,
                                      parent_problem, record_best, sqlite_creation_lock, value_of)

log = logging.getLogger(__name__)
MAX_PARAMS_PER_CALL = 100  # MLflow's batch limit for params
# The link MLflow prints at a run's end opens MLflow 3's UI in whatever view the browser last
# used (GenAI by default): the run logs its own (MLflowTracker.link) instead.
RUN_HTTP_SETTINGS = {"MLFLOW_HTTP_REQUEST_TIMEOUT": "10", "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1",
                     "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT": "true"}
DATASET_CONTEXTS = {"train": "training", "val": "validation"}  # MLflow's usual names
# MLflow keeps the store in a process global and in this variable, which set_tracking_uri
# rewrites: the environment's own value is read before any run here has set it.
LAUNCH_TRACKING_URI = os.environ.get("MLFLOW_TRACKING_URI") or None
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


class Tracker:
    """Where the run's params, metrics and files go. This base logs nothing (`logger=none`,
    and every rank but 0); `MLflowTracker` logs to MLflow."""

    @contextmanager
    def run(self, run_name: str, config: DictConfig, resume_run_id: Optional[str] = None,
            run_dir: Optional[Path] = None) -> Iterator[Optional[str]]:
        yield resume_run_id

    def check(self) -> Optional[str]:
        return None

    def log_metrics(self, metrics: Dict[str, float], step: int) -> None:
        pass

    def last_metrics(self) -> Dict[str, float]:
        return {}

    def log_artifact(self, path: Path) -> None:
        pass

    def log_files(self, paths: List[Path]) -> None:
        pass

    def log_params(self, params: Dict[str, str]) -> None:
        pass

    def log_datasets(self, splits: Dict[str, Any]) -> None:
        pass

    def log_model(self, model: torch.nn.Module, example: torch.Tensor,
                  metadata: Dict[str, Any]) -> None:
        pass


class MLflowTracker(Tracker):
    """Rank 0's MLflow run. A store that fails mid-run never stops training: what it did not
    take (metrics, system metrics, artifacts, the run's end) waits in memory and in the run
    directory's mlflow_unsent.jsonl (train/tracking/unsent.py), and is sent when the store answers
    again: later in the run, at the run's next launch, or by `python -m train.unsent`."""

    def __init__(self, cfg: LoggerConfig) -> None:
        import mlflow  # slow to import: only when MLflow is used

        self.mlflow = mlflow
        self.cfg = cfg
        # Always set, so that a job of an in-process sweep whose URI is unset does not log
        # to the store an earlier job named.
        mlflow.set_tracking_uri(cfg.tracking_uri or LAUNCH_TRACKING_URI)
        self.experiment_name = cfg.experiment_name
        self.uri = strip_credentials(mlflow.get_tracking_uri())
        self.client: Any = None  # made once the store is known to open (check or run)
        self.run_id: Optional[str] = None
        self.experiment_id: Optional[str] = None
        self.sweep: Optional[SweepJob] = None  # set when the run starts under a live parent
        self.unsent = unsent.Unsent(uri=self.uri)
        self.unsent_dir: Optional[Path] = None  # the run directory, which keeps the file
        self.retry_at: Optional[float] = None  # set while the store is failing
        self.system: Optional[SystemMetrics] = None
        self.system_values: "queue.SimpleQueue[Tuple[Dict[str, float], int, int]]" = \
            queue.SimpleQueue()
        # MLflow retries a failed HTTP request for ~4 minutes by default, blocking the step;
        # with what is unsent kept here a short attempt is enough. The user's settings win.
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
    def run(self, run_name: str, config: DictConfig, resume_run_id: Optional[str] = None,
            run_dir: Optional[Path] = None) -> Iterator[Optional[str]]:
        """Start (or, after a resume, reopen) the MLflow run; yields its id. What an earlier
        launch in `run_dir` left unsent goes first.

        MLflow params are immutable, so a resumed run records the config it resumed with
        as tags (`resume.<key>` for each value that differs from the logged params).
        The run ends FAILED if the body raises, KILLED if it was preempted (it goes on
        when the same command runs again).
        """
        self.unsent_dir = run_dir
        try:
            self.run_id = self._start(strip_credentials(run_name), config, resume_run_id)
        except Exception as err:  # the store failed after the start check: train anyway
            log.warning("MLflow store %s failed when starting the run (%s): training goes on "
                        "and this process logs no metrics", self.uri, one_line(err))
            self._end_half_started_run()
            yield resume_run_id
            return
        self._take_back_unsent()
        self.flush()
        self._start_system_metrics()
        status = "FAILED"
        try:
            yield self.run_id
            status = "FINISHED"
        except Preempted:
            status = "KILLED"
            raise
        finally:
            if self.system:
                self.system.finish()
            self.log_files([Path(h.baseFilename) for h in logging.getLogger().handlers
                            if isinstance(h, logging.FileHandler)])  # the run's log
            self._end(status)
            self._record_sweep_best(config)

    def _end(self, status: str) -> None:
        """End the run as `status`, now; what the store does not take is kept, end included."""
        end_time = int(time.time() * 1000)
        sent = self.flush(final=True)
        try:
            self.mlflow.end_run(status)  # drops the active run, then tells the store
            ended = True
        except Exception:  # the store that fails: the end is kept with the rest
            ended = False
        if sent and ended or unsent.gone(self.run_id):  # gone: deleted while it trained
            return
        self.unsent.ends[self.run_id] = (status, end_time)
        self._keep()
        what = (f"{len(self.unsent.metrics) + self.unsent.dropped} metric values, "
                f"{len(self.unsent.artifacts)} files{', the model' if self.unsent.models else ''}"
                f" and the run's end ({status})")
        if self.unsent_dir is None:
            log.warning("MLflow store %s still fails at the end of the run: %s were not "
                        "logged", self.uri, what)
            return
        log.warning("MLflow store %s still fails at the end of the run: %s are kept in %s, "
                    "sent at this run's next launch or by `python -m train.unsent %s`; the "
                    "run stays RUNNING there until then", self.uri, what,
                    self._unsent_file(), self.unsent_dir)

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
        self.experiment_id = experiment.experiment_id
        self.client = mlflow.tracking.MlflowClient()
        params = mlflow_params(config)
        if resume_run_id and not self._exists(resume_run_id):
            log.warning("MLflow run %s is not in %s: starting a new one", resume_run_id,
                        self.uri)
            resume_run_id = None
        sweep = self.sweep = self._sweep_job(experiment.experiment_id)
        # System metrics come from a monitor of our own (SystemMetrics), never MLflow's.
        active = mlflow.start_run(run_id=resume_run_id,
                                  run_name=None if resume_run_id else run_name,
                                  log_system_metrics=False)
        if sweep:  # a resumed job moves to the sweep that finishes it
            mlflow.set_tags(sweep.tags())
        log.info("MLflow run %s (%s): %s", run_name, active.info.run_id,
                 self.link(active.info.run_id))
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

    def link(self, run_id: str) -> str:
        """Where the run opens in MLflow's UI, in its model-training view: MLflow 3 keeps the
        view (GenAI or machine learning) per browser, so the link says which."""
        path = (f"#/experiments/{self.experiment_id}/runs/{run_id}"
                f"?workflowType=machine_learning")
        if self.uri.startswith(("http://", "https://")):
            return f"{self.uri.rstrip('/')}/{path}"
        return f"{path} in `mlflow ui --backend-store-uri {self.uri}`"

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

    def _unsent_file(self) -> Optional[Path]:
        return self.unsent_dir / unsent.FILE if self.unsent_dir else None

    def _take_back_unsent(self) -> None:
        """What an earlier launch in this run directory could not send joins what this one
        sends. This run goes on (its kept end and model are this launch's to write); any
        other run of the file (its launch had no checkpoint to name it) is ended as it
        ended, or, if its process died, FAILED at its last metric's time."""
        path = self._unsent_file()
        if path is None or not path.is_file():
            return
        try:
            earlier = unsent.read(path)
        except OSError as err:
            log.warning("%s could not be read (%s): what it holds stays there", path, err)
            return
        earlier.ends.pop(self.run_id, None)
        for run in {run for run, _ in earlier.metrics} | set(earlier.models):
            if run != self.run_id:
                earlier.ends.setdefault(run, ("FAILED", None))
        log.info("MLflow: sending what an earlier launch kept in %s (%d metric values)", path,
                 len(earlier.metrics))
        self.unsent.metrics.extendleft(reversed(earlier.metrics))
        self.unsent.artifacts[:0] = earlier.artifacts
        self.unsent.ends.update(earlier.ends)  # the models: this launch logs its own

    def _start_system_metrics(self) -> None:
        if not self.cfg.system_metrics:
            return
        try:  # a resumed run's system metrics go on from its last step
            logged = self.client.get_run(self.run_id).data._metric_objs
        except Exception as err:
            log.warning("MLflow store %s failed to give run %s (%s): its system metrics "
                        "start again at step 0", self.uri, self.run_id, one_line(err))
            logged = []
        steps = [m.step for m in logged if m.key.startswith(SystemMetrics.PREFIX)]
        self.system = SystemMetrics(self.system_values.put, self.cfg.system_metrics_seconds,
                                    first_step=max(steps) + 1 if steps else 0)
        self.system.start()

    def log_metrics(self, metrics: Dict[str, float], step: int) -> None:
        if self.run_id is None:  # the run never started: nothing to log into
            return
        if "goodput" in metrics:  # the UI groups by prefix: the headline next to its parts
            metrics = {**metrics, GOODPUT_IN_GROUP: metrics["goodput"]}
        self._queue(metrics, int(time.time() * 1000), step)
        if self.retry_at is None or time.monotonic() >= self.retry_at:
            self.flush()

    def _queue(self, metrics: Dict[str, float], when_ms: int, step: int) -> None:
        """Metric values join what waits to be sent; while the store fails, the file too."""
        if unsent.gone(self.run_id):  # deleted while it trains: nowhere to send them
            return
        lines = self.unsent.add_metrics(self.run_id, [(key, float(value), when_ms, step)
                                                      for key, value in metrics.items()])
        if self.retry_at is not None and self._unsent_file():
            try:
                unsent.append(self._unsent_file(), lines)
            except OSError as err:
                log.warning("%s could not be written (%s)", self._unsent_file(), err)

    def _take_system_metrics(self) -> None:
        while not self.system_values.empty():
            self._queue(*self.system_values.get())

    def last_metrics(self) -> Dict[str, float]:
        """The run's last value of each metric, as the store holds them ({} when it does not
        answer, or the run never started)."""
        if self.run_id is None:
            return {}
        try:
            return dict(self.client.get_run(self.run_id).data.metrics)
        except Exception as err:
            log.warning("MLflow store %s failed to give run %s's metrics (%s)", self.uri,
                        self.run_id, one_line(err))
            return {}

    def log_artifact(self, path: Path) -> None:
        """Attach a file to the run; a store that fails keeps it for later if it is a file of
        the run's directory, else only warns (it is a report)."""
        if self.run_id is None:
            return
        if self.retry_at is None:
            try:
                self.client.log_artifact(self.run_id, str(path))
                return
            except Exception as err:
                log.warning("MLflow store %s failed to take %s (%s)", self.uri, path.name,
                            one_line(err))
                self.retry_at = time.monotonic() + self.cfg.retry_seconds
        if self.unsent_dir and path.resolve().parent == self.unsent_dir.resolve():
            self.unsent.artifacts.append((self.run_id, path.name))
            self._keep()

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

    def log_datasets(self, splits: Dict[str, Any]) -> None:
        """Each split (a data.index.DatasetIndex) as a dataset input of the run: its name, the
        digest of its index, its number of samples and classes, and where it lives (the
        index's URL, credentials stripped)."""
        if self.run_id is None:
            return
        try:
            self.client.log_inputs(self.run_id, datasets=[
                dataset_input(split, index) for split, index in splits.items()])
        except Exception as err:
            log.warning("MLflow store %s failed to take the datasets (%s)", self.uri,
                        one_line(err))

    def log_model(self, model: torch.nn.Module, example: torch.Tensor,
                  metadata: Dict[str, Any]) -> None:
        """The trained model as an MLflow model (`model`), with its signature and an input
        example, registered under `logger.registered_model_name` when set. MLflow 3 saves it
        with torch.export ("pt2"): loading runs no pickled code and needs no class of ours.
        A failure only warns: model_final.pt holds the same weights, and the run's next
        launch logs the model."""
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
            self.unsent.models.append(self.run_id)
            self._keep()

    def flush(self, final: bool = False) -> bool:
        """Send what waits; True when nothing is left. On failure keep it (in memory and in
        the run directory's file) and try again after `logger.retry_seconds`."""
        if self.run_id is None:
            return True
        self._take_system_metrics()
        if not (self.unsent.metrics or self.unsent.artifacts or self.unsent.ends):
            return True
        try:
            sent = unsent.send(self.client, self.unsent, self.unsent_dir or Path("."),
                               finish=list(self.unsent.ends))
        except Exception as err:  # an outage of the store never stops training
            if self.retry_at is None and not final:
                kept = self._unsent_file()
                log.warning("MLflow store %s failed (%s): training goes on; metrics are kept "
                            "in memory%s (up to %d values, the oldest dropped beyond that) "
                            "and sent when it answers again (tried every %gs)", self.uri,
                            one_line(err), f" and in {kept}" if kept else "",
                            unsent.MAX_METRICS, self.cfg.retry_seconds)
            self.retry_at = time.monotonic() + self.cfg.retry_seconds
            self._keep()
            return False
        if self.retry_at is not None:
            log.info("MLflow store %s answers again: sent %d kept metric values (%d "
                     "dropped)", self.uri, sent, self.unsent.dropped)
        self.retry_at, self.unsent.dropped = None, 0
        self._keep()  # nothing left but a missing model, if that: the file goes, or shrinks
        return True

    def _keep(self) -> None:
        """The file holds what is unsent now (none when nothing is)."""
        path = self._unsent_file()
        if path is None:
            return
        try:
            unsent.write(path, self.unsent)
        except OSError as err:
            log.warning("%s could not be written (%s): what is unsent is in memory only",
                        path, err)


class SystemMetrics:
    """MLflow's system monitors (CPU, memory, disk, network, and GPU with nvidia-ml-py)
    sampled every `interval` seconds on a thread of its own, each sample handed to `sink`
    as (values, time in ms, step). MLflow's own monitor thread logs to the store itself and
    stops for good at the first call that fails; these values go with the run's other
    metrics, kept through an outage."""

    PREFIX = "system/"

    def __init__(self, sink: Callable[[Tuple[Dict[str, float], int, int]], None],
                 interval: float, first_step: int = 0) -> None:
        from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

        # Its monitors only: its constructor would open the store.
        monitor = SystemMetricsMonitor.__new__(SystemMetricsMonitor)
        self.monitors = [*_default_monitors(), *filter(None, [
            monitor._initialize_gpu_monitor()])]
        self.sink, self.interval, self.step = sink, interval, first_step
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._sample, name="SystemMetrics", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def finish(self) -> None:
        self.stop.set()
        self.thread.join()

    def _sample(self) -> None:
        while not self.stop.is_set():
            try:
                self._sample_once()
            except Exception as err:  # a monitor that fails (psutil, NVML) ends the sampling
                log.warning("system metrics stop: %s", one_line(err))
                return

    def _sample_once(self) -> None:
        for monitor in self.monitors:
            monitor.collect_metrics()
        if self.stop.wait(self.interval):
            return
        values: Dict[str, float] = {}
        for monitor in self.monitors:
            values.update(monitor.aggregate_metrics())
            monitor.clear_metrics()
        self.sink(({f"{self.PREFIX}{k}": float(v) for k, v in values.items()},
                   int(time.time() * 1000), self.step))
        self.step += 1


def _default_monitors() -> List[Any]:
    from mlflow.system_metrics.metrics.cpu_monitor import CPUMonitor
    from mlflow.system_metrics.metrics.disk_monitor import DiskMonitor
    from mlflow.system_metrics.metrics.network_monitor import NetworkMonitor

    return [CPUMonitor(), DiskMonitor(), NetworkMonitor()]


def dataset_input(split: str, index: Any) -> Any:
    """`index` (a split's data.index.DatasetIndex) as an MLflow dataset input: named by the
    dataset's folder and the split, its source resolved by MLflow where it knows the scheme
    (local, s3, gs, http, ...), else an `external` URI."""
    from mlflow.data.dataset_source_registry import resolve_dataset_source
    from mlflow.entities import Dataset, DatasetInput, InputTag

    url = strip_credentials(index.url)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            source = resolve_dataset_source(url)
        source_type, source_json = source._get_source_type(), strip_credentials(
            source.to_json())
    except Exception:  # a scheme MLflow has no source for (webdav, ...)
        source_type, source_json = "external", json.dumps({"uri": url})
    parts = [p for p in url.rstrip("/").split("/") if p]
    name = "/".join(parts[-2:]) if len(parts) >= 2 else url
    profile = json.dumps({"num_samples": len(index), "num_classes": len(index.classes)})
    return DatasetInput(Dataset(name=name, digest=index.digest, source_type=source_type,
                                source=source_json, profile=profile),
                        tags=[InputTag("mlflow.data.context", DATASET_CONTEXTS.get(split,
                                                                                   split))])


def build_tracker(cfg: LoggerConfig, rank: int) -> Tracker:
    if rank != 0 or cfg.name == LoggerName.none:
        return Tracker()
    return MLflowTracker(cfg)


def start_tracker(cfg: LoggerConfig, world: World) -> Tracker:
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

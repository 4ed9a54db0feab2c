"""A record of each sweep that no later sweep touches: `<run.root>/sweeps/<sweep id>/`.

Hydra writes one `multirun.yaml` into the sweep directory, `run.root`, which every sweep
there shares: the next sweep overwrites the last one's. `SweepRecord` (a Hydra callback,
conf/config.yaml) gives each sweep a directory of its own, named by its start time and a
random suffix (two sweeps started in the same second stay apart):

    multirun.yaml  Hydra's record of the sweep's config, as Hydra writes it
    sweep.yaml     the sweep's id, start and end time, command-line overrides, the keys it
                   varies, its MLflow parent run, and its jobs (number, run name, run
                   directory, overrides, status, objective)
    jobs.jsonl     a line when each job starts and one when it returns, appended by the job's
                   own process (joblib's workers and SLURM jobs too): what sweep.yaml's job
                   list is made of, and the record of a sweep that never reached its end

It also hands the jobs the keys the sweep varies (`SWEPT_KEYS_ENV`), which lead their run
names (train/config.py). Only Hydra and OmegaConf are imported: this runs in the sweep's
own process, which has no use for torch.
"""

from __future__ import annotations

import logging
import os
import secrets
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

import yaml
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from common.files import atomic_file
from common.jsonl import append_line, records
from common.redact import one_line, strip_credentials
from train.config import SWEPT_KEYS_ENV
from train.tracking.sweep_run import PARENT_ENV

log = logging.getLogger(__name__)
RECORD_ENV = "GOODPUT_SWEEP_RECORD"  # the record's directory, for the jobs' processes
SWEEPS_DIR = "sweeps"  # under run.root
JOBS_FILE = "jobs.jsonl"


class SweepRecord(Callback):
    """The sweep's own directory of records: made before the first job, completed after the
    last one. A record that cannot be written warns and never fails the sweep."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        # One left in the shell (an export, an outer sweep) is not this sweep's.
        for name in (RECORD_ENV, SWEPT_KEYS_ENV):
            os.environ.pop(name, None)
        started = time.time()
        sweep_id = sweep_id_of(config)
        overrides = [str(o) for o in OmegaConf.select(config, "hydra.overrides.task",
                                                      default=[]) or []]
        swept = swept_keys(overrides, OmegaConf.select(config, "hydra.sweeper.params"))
        os.environ[SWEPT_KEYS_ENV] = ",".join(swept)
        record = record_dir(config)
        if record is None:
            return
        try:
            record.mkdir(parents=True)
            write_text(record / "multirun.yaml", OmegaConf.to_yaml(config))
            write_sweep(record, {"id": sweep_id, "started": stamp(started), "ended": None,
                                 "overrides": overrides, "swept": swept})
        except OSError as err:
            log.warning("the sweep's record %s could not be written (%s): the sweep goes on "
                        "without it", record, one_line(err))
            return
        os.environ[RECORD_ENV] = str(record)
        log.info("sweep %s: its record is %s", sweep_id, record)

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        append_job(config, {"event": "start"})

    def on_job_end(self, config: DictConfig, job_return: Any, **kwargs: Any) -> None:
        status = getattr(job_return.status, "name", str(job_return.status))
        value = job_return.return_value if status == "COMPLETED" else None
        append_job(config, {"event": "end", "status": status, "objective": number(value)})

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        os.environ.pop(SWEPT_KEYS_ENV, None)
        record = os.environ.pop(RECORD_ENV, None)
        if record is None:
            return
        try:
            sweep = yaml.safe_load((Path(record) / "sweep.yaml").read_text())
            jobs = read_jobs(Path(record) / JOBS_FILE)
            parents = [job.pop("mlflow_parent_run_id", None) for job in jobs]
            sweep.update(ended=stamp(time.time()), mlflow_parent_run_id=next(
                (p for p in parents if p), None), jobs=jobs)
            write_sweep(Path(record), sweep)
        except (OSError, ValueError, AttributeError, yaml.YAMLError) as err:
            log.warning("the sweep's record %s could not be completed (%s)", record,
                        one_line(err))


_SWEEP_IDS: Dict[int, str] = {}


def sweep_id_of(config: DictConfig) -> str:
    """The id of the sweep `config` runs: its start time and a random suffix (two sweeps
    started in the same second stay apart). Every callback of the sweep gets the same one
    (Hydra hands them one config object), the MLflow parent run's name included."""
    return _SWEEP_IDS.setdefault(id(config), f"{time.strftime('%Y%m%d-%H%M%S')}-"
                                             f"{secrets.token_hex(3)}")


def record_dir(config: DictConfig) -> Optional[Path]:
    """Where the sweep `config` runs keeps its record (None: a config without Hydra's)."""
    sweep_dir = OmegaConf.select(config, "hydra.sweep.dir")
    if sweep_dir is None:
        return None
    return Path(str(sweep_dir)).absolute() / SWEEPS_DIR / sweep_id_of(config)


def swept_keys(overrides: List[str], params: Any) -> List[str]:
    """The keys a sweep varies: its sweep overrides (`optim.lr=0.1,0.2`, `range(...)`) and
    the keys of `hydra.sweeper.params` (every sweeper's search space), sorted."""
    keys = set(str(k) for k in (params or {}))
    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except Exception:  # noqa: BLE001  Hydra refuses them itself, with its own message
        parsed = []
    keys.update(o.key_or_group for o in parsed if o.is_sweep_override())
    return sorted(keys)


def number(value: Any) -> Any:
    """An objective as the record keeps it: a number, a list of them (multi-objective), or
    None (a failed job, or a value that is neither)."""
    if isinstance(value, (list, tuple)):
        values = [number(v) for v in value]
        return values if values and None not in values else None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return None


def append_job(config: DictConfig, fields: Dict[str, Any]) -> None:
    """One line about this job in its sweep's jobs.jsonl (a single append: parallel jobs'
    lines never interleave)."""
    record = os.environ.get(RECORD_ENV)
    if not record:
        return
    hydra = config.hydra
    line = {"job": int(hydra.job.num), "run_name": str(config.run.name),
            "dir": strip_credentials(str(hydra.runtime.output_dir)),
            "overrides": [strip_credentials(str(o)) for o in hydra.overrides.task],
            "mlflow_parent_run_id": os.environ.get(PARENT_ENV), "time": stamp(time.time()),
            **fields}
    try:
        append_line(Path(record) / JOBS_FILE, line)
    except OSError as err:
        log.warning("the sweep's record %s could not take job %s (%s)", record, line["job"],
                    one_line(err))


def read_jobs(path: Path) -> List[Dict[str, Any]]:
    """Each job once, by number: its start line updated by its end line, if it has one (a job
    that exited the process, or never returned, stays `status: RUNNING`). A torn line, from a
    process killed mid-write, or one that is no job's line (a hand edit, lines of jobs on NFS
    that interleaved), is skipped: the others still make the record."""
    jobs: Dict[int, Dict[str, Any]] = {}
    for line in records(path) if path.exists() else []:
        if not (type(line.get("job")) is int and isinstance(line.get("time"), str)):
            continue
        number = line["job"]
        job = jobs.setdefault(number, {"job": number, "status": "RUNNING", "objective": None})
        event = line.pop("event", None)
        if event == "start":
            line["started"] = line.pop("time")
        else:
            line["ended"] = line.pop("time")
        job.update(line)
    return [jobs[number] for number in sorted(jobs)]


def write_sweep(record: Path, sweep: Dict[str, Any]) -> None:
    write_text(record / "sweep.yaml", yaml.safe_dump(sweep, sort_keys=False))


def write_text(path: Path, text: str) -> None:
    """Whole or not at all, credentials out (a URL typed into an override)."""
    with atomic_file(path) as f:
        f.write(strip_credentials(text).encode())


def stamp(seconds: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(seconds))


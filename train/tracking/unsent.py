"""What the MLflow store did not take, kept in one file of the run's directory until it does.

`<run dir>/mlflow_unsent.jsonl`, a JSON line per item, each naming its MLflow run:

    {"run": ID, "uri": STORE}                         the store (credentials stripped)
    {"run": ID, "metric": [key, value, time_ms, step]}
    {"run": ID, "artifact": NAME}                     a file of the run's directory
    {"run": ID, "model": true}                        the final model was not logged
    {"run": ID, "end": [status, end_time_ms]}         how and when the run ended (null:
                                                      its process died, time unknown)

The tracker (train/tracking/tracker.py) writes it while the store fails and deletes it once all is
sent; the next launch of the run sends what it holds, and so does

    python -m train.unsent RUN_DIR [--tracking-uri URI]

which then ends each run with its recorded status and end time (a run whose process died
without an end: FAILED, at its last metric's time). It holds the run's lock meanwhile, and is
refused while a trainer of the run lives (that trainer sends what it kept itself). The model
it cannot rebuild: launching the run again logs it (a complete run trains nothing and logs
its final model).

The file is input: it is parsed as JSON only, kept to MAX_METRICS metric values (the oldest
beyond go) of at most MAX_RUNS runs and MAX_ARTIFACTS files, lines longer than MAX_LINE are
skipped unread, a value MLflow would refuse (a step or time beyond 64 bits) is skipped so it
cannot block the rest, and an artifact is a plain file of the run's directory, never a path
or a link elsewhere.
"""

from __future__ import annotations

import argparse
import errno
import json
import logging
import os
import sys
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path
from typing import Any, Deque, Dict, Iterable, Iterator, List, Optional, Set, Tuple

from common import jsonl
from common.files import atomic_file
from common.redact import one_line, strip_credentials
from train.tracking.sweep_run import CHECK_HTTP_SETTINGS

log = logging.getLogger(__name__)
FILE = "mlflow_unsent.jsonl"
MAX_METRICS = 100_000  # ~8 MB on disk, ~20 MB in memory
MAX_LINE = 2048
MAX_METRICS_PER_CALL = 1000  # MLflow's batch limit for metrics
MAX_RUNS = 1000  # a run directory holds one run per launch that had no checkpoint yet
MAX_ARTIFACTS = 1000
INT64 = range(-2**63, 2**63)  # what MLflow stores a metric's time and step in
RUN_STATUSES = ("FINISHED", "FAILED", "KILLED")

MetricRecord = Tuple[str, float, int, int]  # key, value, time (ms), step


@dataclass
class Unsent:
    """Everything not yet sent, by run: metric values (oldest first), artifact names, runs
    whose model is missing, and how the runs ended."""

    uri: str = ""
    metrics: Deque[Tuple[str, MetricRecord]] = field(default_factory=deque)
    artifacts: List[Tuple[str, str]] = field(default_factory=list)
    models: List[str] = field(default_factory=list)
    ends: Dict[str, Tuple[str, Optional[int]]] = field(default_factory=dict)  # None: unknown
    dropped: int = 0  # metric values over MAX_METRICS, lost

    def add_metrics(self, run_id: str, records: Iterable[MetricRecord]) -> List[Dict[str, Any]]:
        """Queue `records`; returns their file lines (for `append`)."""
        lines = []
        for record in records:
            self.metrics.append((run_id, record))
            lines.append({"run": run_id, "metric": list(record)})
        overflow = len(self.metrics) - MAX_METRICS
        for _ in range(max(overflow, 0)):
            self.metrics.popleft()
        self.dropped += max(overflow, 0)
        return lines

    def __bool__(self) -> bool:
        return bool(self.metrics or self.artifacts or self.models or self.ends)

    def lines(self) -> Iterable[Dict[str, Any]]:
        runs = {run for run, _ in self.metrics} | set(self.ends) | set(self.models) | {
            run for run, _ in self.artifacts}
        for run in sorted(runs):
            yield {"run": run, "uri": strip_credentials(self.uri)}
        for run, record in self.metrics:
            yield {"run": run, "metric": list(record)}
        for run, name in self.artifacts:
            yield {"run": run, "artifact": name}
        for run in self.models:
            yield {"run": run, "model": True}
        for run, (status, end_time) in self.ends.items():
            yield {"run": run, "end": [status, end_time]}


def write(path: Path, unsent: Unsent) -> None:
    """The whole file, replaced at once (a crash leaves the old one); none when all is sent."""
    if not unsent:
        path.unlink(missing_ok=True)
        return
    with atomic_file(path) as f:
        f.write("".join(json.dumps(line) + "\n" for line in unsent.lines()).encode())


def append(path: Path, lines: List[Dict[str, Any]]) -> None:
    """More lines in one write, so a crash tears at most the last one (`read` skips it)."""
    if lines:
        with open(path, "ab") as f:
            f.write("".join(json.dumps(line) + "\n" for line in lines).encode())


def read(path: Path) -> Unsent:
    """The file's content, checked item by item; a missing file is nothing unsent."""
    unsent = Unsent()
    runs: Set[str] = set()
    artifacts: Set[Tuple[str, str]] = set()  # a set: a file of repeats is read in linear time
    try:
        for item in jsonl.records(path, MAX_LINE):  # a torn or too long line: skipped unread
            if not _is_run_id(item.get("run")):
                continue
            if item["run"] not in runs:
                if len(runs) >= MAX_RUNS:
                    continue
                runs.add(item["run"])
            _add(unsent, item, artifacts)
    except FileNotFoundError:
        return unsent
    return unsent


def _is_run_id(value: Any) -> bool:
    return isinstance(value, str) and 0 < len(value) <= 64 and value.isalnum()


def _is_int64(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value in INT64


def _add(unsent: Unsent, item: Dict[str, Any], artifacts: Set[Tuple[str, str]]) -> None:
    run = item["run"]
    if isinstance(item.get("uri"), str):
        unsent.uri = strip_credentials(item["uri"])
    metric = item.get("metric")
    if (isinstance(metric, list) and len(metric) == 4 and isinstance(metric[0], str)
            and len(metric[0]) <= 250 and (isinstance(metric[1], float) or _is_int64(metric[1]))
            and all(_is_int64(v) for v in metric[2:])):
        unsent.add_metrics(run, [(metric[0], float(metric[1]), metric[2], metric[3])])
    name = item.get("artifact")
    if (isinstance(name, str) and name == Path(name).name and name not in ("", ".", "..")
            and (run, name) not in artifacts and len(artifacts) < MAX_ARTIFACTS):
        unsent.artifacts.append((run, name))
        artifacts.add((run, name))
    if item.get("model") is True and run not in unsent.models:
        unsent.models.append(run)
    end = item.get("end")
    if (isinstance(end, list) and len(end) == 2 and end[0] in RUN_STATUSES
            and (end[1] is None or isinstance(end[1], int) and not isinstance(end[1], bool))):
        unsent.ends[run] = (end[0], end[1])


def send(client: Any, unsent: Unsent, run_dir: Path, finish: Iterable[str]) -> int:
    """Send `unsent` through `client`, taking off what the store took (a failure raises and
    leaves the rest); then end each run of `finish` as it ended (or FAILED at its last
    metric's time). What the store refuses, rather than fails to take (a metric name it does
    not allow, a run deleted or not there), is dropped with a warning: kept, it would fail
    every send after it, as if the store were down for good. Returns the number of metric
    values sent."""
    from mlflow.entities import Metric

    sent, gone = 0, set()  # gone: runs the store does not have (any more)
    while unsent.metrics:
        run = unsent.metrics[0][0]
        batch = list(_leading(unsent.metrics, run, MAX_METRICS_PER_CALL))
        try:
            client.log_batch(run, metrics=[Metric(k, v, t, s) for _, (k, v, t, s) in batch])
        except Exception as err:
            if not _refused(err):
                raise
            if not _takes(client, run, err, unsent, gone):
                continue
            batch = batch[:1]  # one at a time, to find those it refuses
            try:
                client.log_batch(run, metrics=[Metric(*batch[0][1])])
            except Exception as one:
                if not _refused(one):
                    raise
                log.warning("MLflow store refused run %s's metric %s (%s): dropped", run,
                            ascii(batch[0][1][0][:80]), one_line(one))
                unsent.metrics.popleft()
                continue
        for _ in batch:
            unsent.metrics.popleft()
        sent += len(batch)
    while unsent.artifacts:
        run, name = unsent.artifacts[0]
        if _in_run_dir(run_dir / name, run_dir):
            try:
                client.log_artifact(run, str(run_dir / name))
            except Exception as err:
                if not _refused(err):
                    raise
                if not _takes(client, run, err, unsent, gone):
                    continue  # it went with the rest of its run's
                log.warning("MLflow store refused run %s's file %s (%s): dropped", run,
                            ascii(name), one_line(err))
        unsent.artifacts.pop(0)
    for run in [run for run in finish if run not in gone]:
        status, end_time = unsent.ends.get(run, ("FAILED", None))
        try:
            client.set_terminated(run, status, end_time=end_time or _last_time(client, run))
        except Exception as err:
            if not _refused(err):
                raise
            if _takes(client, run, err, unsent, gone):
                log.warning("MLflow store refused to end run %s (%s)", run, one_line(err))
        unsent.ends.pop(run, None)
    return sent


# What the store answers when it is up but refuses a request: sending it again fails again.
REFUSALS = ("INVALID_PARAMETER_VALUE", "RESOURCE_DOES_NOT_EXIST", "INVALID_STATE",
            "BAD_REQUEST")


_DROPPED: Set[str] = set()  # the runs this process was told are gone


def gone(run: Optional[str]) -> bool:
    """Whether the store told this process that `run` is deleted or not there."""
    return run in _DROPPED


def _refused(err: Exception) -> bool:
    return getattr(err, "error_code", None) in REFUSALS


def _takes(client: Any, run: str, err: Exception, unsent: Unsent, gone: Set[str]) -> bool:
    """Whether `run` is a live run of the store, after it refused something of it; if not,
    all that is kept for it goes (with a warning), and it joins `gone`."""
    try:
        if client.get_run(run).info.lifecycle_stage == "active":
            return True
    except Exception as lookup:
        if not _refused(lookup):
            raise
    if run not in _DROPPED:  # a live run deleted in the UI: said once, not at every step
        log.warning("MLflow store refused run %s (%s): it is deleted or not there, so what "
                    "is kept for it, now and later, is dropped", run, one_line(err))
        _DROPPED.add(run)
    unsent.metrics = deque(item for item in unsent.metrics if item[0] != run)
    unsent.artifacts = [item for item in unsent.artifacts if item[0] != run]
    unsent.models = [item for item in unsent.models if item != run]
    unsent.ends.pop(run, None)
    gone.add(run)
    return False


def _in_run_dir(path: Path, run_dir: Path) -> bool:
    """A plain file of the run's directory: a link to a file elsewhere (a key, a config with
    secrets) is never uploaded."""
    return path.is_file() and not path.is_symlink() and \
        path.resolve().parent == run_dir.resolve()


def _leading(records: Deque[Tuple[str, MetricRecord]], run: str,
             limit: int) -> Iterable[Tuple[str, MetricRecord]]:
    """The first records, up to `limit`, as long as they are `run`'s."""
    for item in islice(records, limit):
        if item[0] != run:
            return
        yield item


def _last_time(client: Any, run: str) -> Optional[int]:
    """When a run whose process died was last heard of: its last metric, else its start."""
    info = client.get_run(run)
    times = [m.timestamp for m in info.data._metric_objs] or [info.info.start_time]
    return max(t for t in times if t is not None) if any(times) else None


def _missing(client: Any, run: str) -> bool:
    try:
        client.get_run(run)
        return False
    except Exception as err:
        if getattr(err, "error_code", None) == "RESOURCE_DOES_NOT_EXIST":
            return True
        raise


def main(argv: Optional[List[str]] = None) -> int:
    """`python -m train.unsent RUN_DIR`: send what the store did not take, end the runs."""
    parser = argparse.ArgumentParser(
        prog="python -m train.unsent", description="Send to MLflow what a run kept in "
        f"RUN_DIR/{FILE} while the store was down, and end its runs as they ended.")
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--tracking-uri", help="the store (default: MLFLOW_TRACKING_URI, "
                        f"else the one the file names if the run's {CONFIG} names it too)")
    args = parser.parse_args(argv)
    path = args.run_dir / FILE
    if not args.run_dir.is_dir():
        print(f"error: {ascii(str(args.run_dir))[1:-1]} is no directory: give a run's "
              f"directory (outputs/RUN_NAME)", file=sys.stderr)
        return 2
    if not path.is_file():
        print(f"nothing unsent in {args.run_dir} (no {FILE})")
        return 0
    with run_lock(args.run_dir) as holder:
        if holder:  # it would end a live run FAILED, and send what that run sends itself
            print(f"error: the run in {args.run_dir} is live ({holder}): it sends what it "
                  f"kept once the store answers; run this only after it ended",
                  file=sys.stderr)
            return 2
        return _send_kept(args, path)


@contextmanager
def run_lock(run_dir: Path) -> Iterator[Optional[str]]:
    """The run's lock (train/cluster/runlock.py) for the block, so that no trainer of the run
    starts meanwhile; yields None, or the live trainer that holds it, in words."""
    import fcntl

    from train.cluster.runlock import LOCK_FILE, describe_holder

    fd = os.open(run_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            if err.errno not in (errno.EACCES, errno.EAGAIN):
                raise
            yield describe_holder(os.pread(fd, 1 << 16, 0).decode(errors="replace"))
            return
        yield None
    finally:
        os.close(fd)  # which drops the lock


CONFIG = ".hydra/config.yaml"  # Hydra's record of the run's config, in its directory


def configured_store(run_dir: Path) -> Optional[str]:
    """`logger.tracking_uri` of the run's own config (credentials stripped; left unset, it
    means MLflow's default store), None when the file is missing, unreadable, odd or
    oversized."""
    import yaml

    try:
        with open(run_dir / CONFIG, "rb") as f:
            text = f.read(1 << 20)
        config = yaml.safe_load(text)
        uri = config["logger"]["tracking_uri"]
    except (OSError, yaml.YAMLError, TypeError, KeyError, RecursionError):
        return None
    if uri is None:
        import mlflow

        uri = mlflow.get_tracking_uri()  # MLFLOW_TRACKING_URI is unset when this is asked
    return strip_credentials(uri) if isinstance(uri, str) else None


def _send_kept(args: argparse.Namespace, path: Path) -> int:
    unsent = read(path)
    uri = args.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or unsent.uri
    if not uri:
        print(f"error: {path} names no store: pass --tracking-uri URI", file=sys.stderr)
        return 2
    if uri == unsent.uri and unsent.uri != configured_store(args.run_dir):
        # The file alone is not trusted to choose where the run's files go.
        print(f"error: {path} names the store {unsent.uri}, which the run's own config "
              f"({CONFIG}) does not: pass --tracking-uri URI to send there; the file is kept",
              file=sys.stderr)
        return 2
    for name, value in CHECK_HTTP_SETTINGS.items():  # a store that is down: seconds, not
        os.environ.setdefault(name, value)           # MLflow's 4 minutes of retries
    import mlflow

    try:
        client = mlflow.MlflowClient(tracking_uri=uri)
    except Exception as err:  # noqa: BLE001  a scheme or path MLflow cannot open
        print(f"error: {strip_credentials(uri)} is no MLflow store MLflow can open "
              f"({one_line(err)}): fix --tracking-uri", file=sys.stderr)
        return 2
    runs = sorted({run for run, _ in unsent.metrics} | set(unsent.ends))
    models, count = list(unsent.models), len(unsent.metrics)
    try:
        missing = [run for run in sorted(set(runs) | {run for run, _ in unsent.artifacts})
                   if _missing(client, run)]
        if missing:  # the wrong store, most likely: sending would drop what is kept for them
            print(f"error: run(s) {', '.join(missing)} of {path} are not in the MLflow store "
                  f"{strip_credentials(uri)} (the file names {unsent.uri or 'none'}): give "
                  f"the store the run logged to with --tracking-uri; the file is kept",
                  file=sys.stderr)
            return 2
        sent = send(client, unsent, args.run_dir, runs)
    except Exception as err:  # noqa: BLE001  any failure of the store means the same
        write(path, unsent)
        print(f"error: the MLflow store {strip_credentials(uri)} failed ({one_line(err)}): "
              f"{len(unsent.metrics)} of {count} metric values still unsent in {path}; run "
              f"this again once it answers", file=sys.stderr)
        return 1
    unsent.models = []
    write(path, unsent)
    print(f"sent {sent} metric values to {strip_credentials(uri)} and ended "
          f"{len(runs)} run(s)")
    if models:
        print(f"the final model of run(s) {', '.join(models)} was not logged: launch the run "
              f"again (it trains nothing and logs the model)")
    return 0


"""What the tests read back from an MLflow store."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any, List, Optional, Tuple


def mlflow_runs(db: Path) -> Tuple[Any, List[Any]]:
    """(a client of the sqlite store `db`, the runs of the goodput-trainer experiment)."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{db}")
    experiment = client.get_experiment_by_name("goodput-trainer")
    return client, client.search_runs([experiment.experiment_id])


def sweep_runs(runs: List[Any]) -> Tuple[Any, List[Any]]:
    """(the sweep's parent run, its children by job number), checked: one parent, FINISHED,
    holding the best objective of its children and which job it was."""
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    assert len(parents) == 1, [r.info.run_name for r in parents]
    parent = parents[0]
    jobs = sorted((r for r in runs if r is not parent), key=lambda r: int(r.data.tags["sweep.job"]))
    assert [r.data.tags["sweep.job"] for r in jobs] == [str(i) for i in range(len(jobs))]
    for job in jobs:
        assert job.data.tags["mlflow.parentRunId"] == parent.info.run_id
        assert job.data.tags["sweep.id"] == parent.data.tags["sweep.id"]
        assert "optim.lr=" in job.data.tags["sweep.overrides"]
    assert parent.info.status == "FINISHED"
    best = max(jobs, key=lambda r: r.data.metrics["val/top1"])
    assert parent.data.metrics["best/val/top1"] == best.data.metrics["val/top1"]
    assert parent.data.tags["best.job"] == best.data.tags["sweep.job"]
    return parent, jobs


class MlflowServer:
    """A real `mlflow server` on loopback (sqlite backend, artifacts on disk), in a session of
    its own, killed with everything it started (uvicorn, its job runner) by its pid, and
    started again on the same port and store."""

    def __init__(self, root: Path) -> None:
        from support.launch import free_port

        root.mkdir(parents=True, exist_ok=True)
        self.root, self.port = root, free_port()
        self.uri = f"http://127.0.0.1:{self.port}"
        self.proc: Optional[subprocess.Popen] = None

    def start(self) -> None:
        from support.launch import wait_for

        log = open(self.root / "server.log", "a")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1",
             "--port", str(self.port), "--workers", "1",
             "--backend-store-uri", f"sqlite:///{self.root / 'mlflow.db'}",
             "--artifacts-destination", str(self.root / "artifacts")],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            # no job runner: a second process the tests never use, seconds to start
            env={**{k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")},
                 "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"})
        wait_for(self.answers, "the MLflow server to answer", timeout=180, proc=self.proc)

    def answers(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.uri}/health", timeout=2) as reply:
                return reply.status == 200
        except OSError:
            return False

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

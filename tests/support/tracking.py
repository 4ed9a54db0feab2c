"""What the tests read back from an MLflow store."""

from __future__ import annotations

from pathlib import Path
from typing import Any, List, Tuple


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

"""What MLflow costs a run and a parallel sweep, measured side by side (docs/benchmarks.md).

1. Parallel jobs' writes (`--writers N`): N processes, each one run logging `--batches`
   log lines of 20 metrics as fast as it can (a sweep's jobs at their worst: every job
   logging at once), into (a) one sqlite store shared by all, as a joblib sweep does, and
   (b) a store per process; (c) one process alone is the baseline. Per log line: median and
   p99 latency, failed calls, and whether every value landed (read back and counted).
2. `mlflow.pytorch.log_model` of the tiny CNN with the pip requirements given (as
   train/tracking/tracker.py does) and inferred by MLflow (its default).

Rounds interleave the variants; figures are medians over rounds.

    python benchmarks/mlflow_tracking.py [--writers 4] [--batches 100] [--rounds 3]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Tuple

METRICS_PER_LINE = 20
EXPERIMENT = "bench"


def writer(uri: str, batches: int, start: "mp.synchronize.Barrier",
           out: "mp.Queue") -> None:
    """One job: a run, `batches` log lines as fast as it can; (latencies, failures, run)."""
    from mlflow.entities import Metric
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name(EXPERIMENT).experiment_id
    run_id = client.create_run(experiment).info.run_id
    start.wait()
    latencies, failures = [], 0
    for step in range(batches):
        now = int(time.time() * 1000)
        metrics = [Metric(f"m/{i}", float(step), now, step) for i in range(METRICS_PER_LINE)]
        began = time.perf_counter()
        try:
            client.log_batch(run_id, metrics=metrics)
        except Exception:  # what a job would see: counted, not retried
            failures += 1
        latencies.append(time.perf_counter() - began)
    out.put((latencies, failures, uri, run_id))


def make_store(uri: str) -> None:
    from mlflow.tracking import MlflowClient

    MlflowClient(tracking_uri=uri).create_experiment(EXPERIMENT)


def landed(uri: str, run_id: str) -> int:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    return sum(len(client.get_metric_history(run_id, f"m/{i}"))
               for i in range(METRICS_PER_LINE))


def parallel_writes(uris: List[str], batches: int) -> Dict[str, float]:
    """One process per entry of `uris` (an entry repeated = a shared store)."""
    ctx = mp.get_context("spawn")
    start, out = ctx.Barrier(len(uris)), ctx.Queue()
    procs = [ctx.Process(target=writer, args=(uri, batches, start, out)) for uri in uris]
    for p in procs:
        p.start()
    results = [out.get() for _ in procs]
    for p in procs:
        p.join()
    latencies = sorted(x for r in results for x in r[0])
    lost = sum(batches * METRICS_PER_LINE - landed(uri, run) for _, _, uri, run in results)
    return {"median_ms": 1000 * statistics.median(latencies),
            "p99_ms": 1000 * latencies[int(0.99 * (len(latencies) - 1))],
            "failed": float(sum(r[1] for r in results)), "lost": float(lost)}


def log_model_seconds(root: Path, inferred: bool) -> float:
    import mlflow
    import torch
    from mlflow.models import infer_signature
    from omegaconf import OmegaConf

    from train.learn.model import build_model
    from train.tracking.tracker import model_requirements

    mlflow.set_tracking_uri(f"sqlite:///{root}/model.db")
    mlflow.set_experiment("bench-model")
    model = build_model(OmegaConf.create({"name": "tiny_cnn", "dropout": 0.0}), 10).eval()
    example = torch.zeros(2, 3, 32, 32)
    with mlflow.start_run():
        began = time.perf_counter()
        with torch.no_grad():
            signature = infer_signature(example.numpy(), model(example).numpy())
        mlflow.pytorch.log_model(model, name="model", signature=signature,
                                 input_example=example.numpy(),
                                 pip_requirements=None if inferred else model_requirements())
        return time.perf_counter() - began


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--writers", type=int, default=4)
    parser.add_argument("--batches", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--skip-model", action="store_true")
    args = parser.parse_args()
    rows: Dict[str, List[Dict[str, float]]] = {"alone": [], "shared": [], "per_job": []}
    models: Dict[str, List[float]] = {"given": [], "inferred": []}
    with tempfile.TemporaryDirectory(prefix="mlflow-bench-") as tmp:
        for r in range(args.rounds):
            variants: List[Tuple[str, List[str]]] = [
                ("alone", [f"sqlite:///{tmp}/alone{r}.db"]),
                ("shared", [f"sqlite:///{tmp}/shared{r}.db"] * args.writers),
                ("per_job", [f"sqlite:///{tmp}/job{r}_{i}.db" for i in range(args.writers)])]
            for name, uris in variants[r % 3:] + variants[:r % 3]:  # a rotating order
                for uri in set(uris):
                    make_store(uri)
                rows[name].append(parallel_writes(uris, args.batches))
                print(f"round {r} {name:8s} {rows[name][-1]}", flush=True)
            if not args.skip_model:
                for kind in (("given", "inferred") if r % 2 == 0 else ("inferred", "given")):
                    models[kind].append(log_model_seconds(Path(tmp), kind == "inferred"))
                    print(f"round {r} log_model ({kind} requirements) "
                          f"{models[kind][-1]:.2f} s", flush=True)
    print(f"\n{args.writers} writers x {args.batches} log lines of {METRICS_PER_LINE} metrics, "
          f"medians of {args.rounds} rounds (sqlite stores)")
    base = statistics.median(x["median_ms"] for x in rows["alone"])
    for name, results in rows.items():
        med = statistics.median(x["median_ms"] for x in results)
        p99 = statistics.median(x["p99_ms"] for x in results)
        print(f"  {name:8s} median {med:7.1f} ms ({med / base:4.2f}x alone)  p99 "
              f"{p99:7.1f} ms  failed calls {sum(x['failed'] for x in results):.0f}  "
              f"values lost {sum(x['lost'] for x in results):.0f}")
    if models["given"]:
        given, inferred = (statistics.median(models[k]) for k in ("given", "inferred"))
        print(f"log_model, tiny CNN: requirements given {given:.2f} s, inferred "
              f"{inferred:.2f} s ({inferred / given:.1f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""How long does a failure cost? Restart-to-first-step and goodput under real faults.

    python benchmarks/recovery.py [--model resnet18] [--nproc 2]

One torchrun job (`--max-restarts 4`, gloo on CPU, DDP) trains the shapes dataset with four
faults armed through GOODPUT_FAULT, `--gap` steps apart, each a real signal or a real NaN:

  (a) SIGKILL of rank 1
  (b) SIGKILL of rank 0
  (c) a NaN loss on rank 1: an in-process rollback to the last checkpoint, no restart
  (d) SIGSTOP of rank 1: caught by rank 0's collective timeout (`--timeout` seconds), then
      torchrun's shutdown grace (30 s, fixed) before the frozen rank is SIGKILLed

It prints, for each, the time from the fault (the time its marker records) to the job's
next completed step (the audit ledger's timestamps), then the run's goodput and its parts
(`goodput.json`), and how the job ended. Absolute times depend on the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests")]

from conftest import torchrun  # noqa: E402  (the tests' launch helpers, shared)
from data import synthetic  # noqa: E402
from faultlib import finish, launch, ledger_records, worker_pids  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet18")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--images", type=int, default=1000)
    parser.add_argument("--timeout", type=float, default=10.0, help="strategy.timeout_seconds")
    parser.add_argument("--gap", type=int, default=15, help="steps between faults")
    opts = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="recovery-"))
    data, runs = work / "data", work / "runs"
    synthetic.generate(data, opts.images, 100, 64, seed=0, workers=2)
    ledger = runs / "ledger.jsonl"
    args = ["-m", "train", f"data.root={data}", f"model.name={opts.model}", "strategy=ddp",
            "data.image_size=64", "data.global_batch_size=32", "data.num_workers=1",
            "trainer.max_epochs=3", "trainer.device=cpu", "logger=none",
            "checkpoint.interval_steps=5", f"strategy.timeout_seconds={opts.timeout}",
            f"audit.ledger={ledger}", f"run.root={runs}", "run.name=bench"]
    g = opts.gap
    faults = {f"kill:rank=1:step={g}": "SIGKILL rank 1",
              f"kill:rank=0:step={2 * g}": "SIGKILL rank 0",
              f"nan:rank=1:step={3 * g}": "NaN loss on rank 1 (rollback)",
              f"stop:rank=1:step={4 * g}": "SIGSTOP rank 1"}
    job = launch(torchrun(opts.nproc, max_restarts=4), args, fault=";".join(faults),
                 log=work / "job.log")
    try:
        finish(job, timeout=1800)
    finally:
        for pid in worker_pids(runs).values():  # a stopped rank left behind by a failure
            os.kill(pid, signal.SIGKILL)
    goodput = json.loads((runs / "bench" / "goodput.json").read_text())
    print(f"\n{opts.model}, {opts.nproc} ranks (gloo, CPU), timeout {opts.timeout:g}s")
    print(f"{'fault':34s} fault -> next completed step")
    for marker in sorted((runs / "bench" / "faults").iterdir(), key=lambda p: p.stat().st_mtime):
        fired = float(marker.read_text())
        name = next(n for spec, n in faults.items() if marker.name.startswith(
            spec.replace(":", "_")))
        after = [r["time"] for r in ledger_records(ledger) if r["time"] > fired]
        print(f"{name:34s} {min(after) - fired:6.1f} s" if after else f"{name:34s} never")
    total = sum(goodput["seconds"].values())
    print(f"goodput {goodput['seconds']['compute'] / total:.1%} over {total:.0f}s: " +
          ", ".join(f"{k} {v:.1f}s" for k, v in goodput["seconds"].items()))
    print(f"job exit code {job.returncode}")
    shutil.rmtree(work)


if __name__ == "__main__":
    main()

"""How long does a failure cost? Restart-to-first-step and goodput under real faults.

    python benchmarks/recovery.py [--model resnet18] [--nproc 2]
    python benchmarks/recovery.py --inband [--model resnet18]

Default: one torchrun job (`--max-restarts 4`, gloo on CPU, DDP) trains the shapes dataset
with four faults armed through GOODPUT_FAULT, `--gap` steps apart, each a real signal or a
real NaN:

  (a) SIGKILL of rank 1
  (b) SIGKILL of rank 0
  (c) a NaN loss on rank 1: an in-process rollback to the last checkpoint, no restart
  (d) SIGSTOP of rank 1: caught by rank 0's collective timeout (`--timeout` seconds), then
      torchrun's shutdown grace (30 s, fixed) before the frozen rank is SIGKILLed

`--inband`: the two SIGKILLs (a) and (b), side by side on the restart path (the DDP job
above) and on in-band recovery (strategy=ddp_ft: two replica groups of one process each,
each its own `torchrun --max-restarts 1` job, under a torchft lighthouse): the killed group
is restarted by its torchrun and heals from the survivor, which never stops.

It prints, for each fault, the time from the fault (the time its marker records) to the
job's next completed step (the audit ledger's timestamps), then goodput and its parts
(`goodput.json`; in-band, per group, with the degraded and heal seconds), and how the jobs
ended. Absolute times depend on the machine.
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
from typing import Dict, List

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests")]

from data import synthetic  # noqa: E402
from support.launch import finish, free_port, launch, torchrun  # noqa: E402
from support.launch import worker_pids  # noqa: E402
from support.lighthouse import start_lighthouse  # noqa: E402
from support.ledger import ledger_records  # noqa: E402


def common_args(opts: argparse.Namespace, data: Path, runs: Path) -> List[str]:
    return ["-m", "train", f"data.root={data}", f"model.name={opts.model}",
            "data.image_size=64", "data.global_batch_size=32", "data.num_workers=1",
            "trainer.max_epochs=3", "trainer.device=cpu", "logger=none",
            "checkpoint.interval_steps=5", f"strategy.timeout_seconds={opts.timeout}",
            f"audit.ledger={runs / 'ledger.jsonl'}", f"run.root={runs}", "run.name=bench"]


def fault_times(run_dirs: List[Path], names: Dict[str, str], ledger: Path) -> List[str]:
    """One line per fault that fired: its name and the time to the next completed step."""
    markers = sorted((m for d in run_dirs if (d / "faults").is_dir()
                      for m in (d / "faults").iterdir()), key=lambda p: p.stat().st_mtime)
    lines = []
    for marker in markers:
        fired = float(marker.read_text())
        name = next((n for spec, n in names.items()
                     if marker.name.startswith(spec.replace(":", "_"))), None)
        if name is None:
            continue
        after = [r["time"] for r in ledger_records(ledger) if r["time"] > fired]
        lines.append(f"{name:34s} {min(after) - fired:6.1f} s" if after else f"{name:34s} never")
    return lines


def goodput_line(run_dir: Path) -> str:
    goodput = json.loads((run_dir / "goodput.json").read_text())
    total = sum(goodput["seconds"].values())
    return (f"goodput {goodput['seconds']['compute'] / total:.1%} over {total:.0f}s: " +
            ", ".join(f"{k} {v:.1f}s" for k, v in goodput["seconds"].items()))


def restart_path(opts: argparse.Namespace, work: Path, faults: Dict[str, str]) -> List[str]:
    runs = work / "restart"
    job = launch(torchrun(opts.nproc, max_restarts=4),
                 common_args(opts, work / "data", runs) + ["strategy=ddp"],
                 fault=";".join(faults), log=work / "restart.log")
    try:
        finish(job, timeout=1800)
    finally:
        for pid in worker_pids(runs).values():  # a stopped rank left behind by a failure
            os.kill(pid, signal.SIGKILL)
    return [*fault_times([runs / "bench"], faults, runs / "ledger.jsonl"),
            goodput_line(runs / "bench"), f"job exit code {job.returncode}"]


def inband_path(opts: argparse.Namespace, work: Path, g: int) -> List[str]:
    runs, port = work / "inband", free_port()
    lighthouse = start_lighthouse(port)
    faults = {f"kill:step={g}": "SIGKILL group 1", f"kill:step={2 * g}": "SIGKILL group 0"}
    jobs = []
    try:
        for replica, fault in ((0, f"kill:step={2 * g}"), (1, f"kill:step={g}")):
            args = common_args(opts, work / "data", runs) + [
                "strategy=ddp_ft", f"strategy.fault_tolerance.lighthouse=http://127.0.0.1:{port}",
                f"strategy.fault_tolerance.replica_id={replica}"]
            jobs.append(launch(torchrun(1, max_restarts=1), args, fault=fault,
                               log=work / f"inband{replica}.log"))
        for job in jobs:
            finish(job, timeout=1800)
    finally:
        lighthouse.kill()
    groups = [runs / "bench" / f"replica_{r}" for r in (0, 1)]
    lines = fault_times(groups, faults, runs / "ledger.jsonl")
    for replica, group in enumerate(groups):
        heals = [json.loads(line) for line in (group / "events.jsonl").read_text().splitlines()
                 if '"kind":"heal"' in line]
        lines.append(f"group {replica}: {goodput_line(group)}; heals: " +
                     (", ".join(f"step {h['step']} -> {h['to_step']} in {h['seconds']:.2f}s"
                                for h in heals) or "none"))
    lines.append(f"job exit codes {[job.returncode for job in jobs]}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet18")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--images", type=int, default=1000)
    parser.add_argument("--timeout", type=float, default=10.0, help="strategy.timeout_seconds")
    parser.add_argument("--gap", type=int, default=15, help="steps between faults")
    parser.add_argument("--inband", action="store_true",
                        help="the two SIGKILLs, restart path vs in-band (strategy=ddp_ft)")
    opts = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="recovery-"))
    synthetic.generate(work / "data", opts.images, 100, 64, seed=0, workers=2)
    g = opts.gap
    faults = {f"kill:rank=1:step={g}": "SIGKILL rank 1",
              f"kill:rank=0:step={2 * g}": "SIGKILL rank 0"}
    if not opts.inband:
        faults.update({f"nan:rank=1:step={3 * g}": "NaN loss on rank 1 (rollback)",
                       f"stop:rank=1:step={4 * g}": "SIGSTOP rank 1"})
    print(f"\n{opts.model}, {opts.nproc} ranks (gloo, CPU), timeout {opts.timeout:g}s")
    print(f"{'restart path: fault':34s} fault -> next completed step")
    print("\n".join(restart_path(opts, work, faults)))
    if opts.inband:
        print(f"\n{'in-band (ddp_ft, 2 groups): fault':34s} fault -> next completed step")
        print("\n".join(inband_path(opts, work, g)))
    shutil.rmtree(work)


if __name__ == "__main__":
    main()

"""What do the per-step health checks cost? The same DDP run with `health.enabled` on and
off, interleaved, side by side.

    python benchmarks/health_overhead.py [--rounds 3] [--model resnet18]

Each round runs both settings (torchrun, 2 ranks, gloo on CPU) and reads the training
throughput each run logs (`train/images_per_second`, the mean over its log windows after
the first); the best of the rounds is kept for each (other processes on a shared machine
only ever slow a run down). On: one all-reduce of three numbers per step, the loss and the
gradient norm read on the host, the running median, and a replica checksum every
`--replica-every` steps. Off: none of that (the gradient norm is still computed: clipping
and logging use it either way).
"""

from __future__ import annotations

import argparse
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests")]

from conftest import torchrun, train_env  # noqa: E402  (the tests' launch helpers, shared)
from data import synthetic  # noqa: E402


def images_per_second(args: list, log: Path) -> float:
    out = subprocess.run([*torchrun(2), *args], cwd=REPO, env=train_env(),
                         capture_output=True, text=True, check=True).stdout
    log.write_text(out)
    text = (Path(args[-1].split("=", 1)[1]) / "bench" / "train.log").read_text()
    rates = [float(x) for x in re.findall(r"train/images_per_second=([\d.]+)", text)]
    return statistics.mean(rates[1:])  # the first window includes warm-up


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet18")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--replica-every", type=int, default=100)
    opts = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="health-"))
    synthetic.generate(work / "data", 2000, 100, 64, seed=0, workers=2)
    best = {True: 0.0, False: 0.0}
    for r in range(opts.rounds):
        for enabled in (True, False):
            runs = work / f"runs-{r}-{enabled}"
            args = ["-m", "train", f"data.root={work / 'data'}", f"model.name={opts.model}",
                    "strategy=ddp", "data.image_size=64", "data.global_batch_size=32",
                    "data.num_workers=1", f"trainer.max_steps={opts.steps}",
                    "trainer.log_every_steps=10", "trainer.device=cpu", "logger=none",
                    "checkpoint.enabled=false", f"health.enabled={enabled}",
                    f"health.replica_check_steps={opts.replica_every}", "run.name=bench",
                    f"run.root={runs}"]
            rate = images_per_second(args, work / f"{r}-{enabled}.log")
            best[enabled] = max(best[enabled], rate)
            print(f"round {r}: health {'on ' if enabled else 'off'} {rate:7.1f} img/s",
                  flush=True)
    print(f"\n{opts.model}, 2 ranks (DDP, gloo, CPU), best of {opts.rounds}: "
          f"on {best[True]:.1f} img/s, off {best[False]:.1f} img/s, "
          f"on/off = {best[True] / best[False]:.3f}")
    shutil.rmtree(work)


if __name__ == "__main__":
    main()

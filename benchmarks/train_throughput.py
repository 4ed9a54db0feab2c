"""Training throughput: our loop against a bare loop over the same batches, side by side.

    python benchmarks/train_throughput.py [--rounds 4] [--steps 40]   # about 12 minutes

Part 1, the whole loop. Each round runs, in alternating order:
  (a) ours: `python -m train +experiment=resnet` (ResNet-18, the shapes dataset at 64 px,
      batches of 128, 2 loader workers, AdamW), checkpoints and MLflow off;
  (b) ours with `trainer.deterministic=false`;
  (c) a bare loop: the same model, optimizer and batches from our loader
      (`data.pipeline.build_loader`), forward / backward / step only, torch's defaults.
Each is a fresh process; the rate is images over the wall time from the end of step
`--warmup` to the end of the last step (for (a) and (b) read from the log lines'
timestamps, so logging, health checks and bookkeeping are inside it). Ratios are taken
within a round (runs minutes apart on a shared machine are not comparable), and the
medians over rounds are printed.

Part 2, what each item of a step costs, in one process: the compute-only step (synthetic
batch, same model and optimizer) alone and with one item added, interleaved step by step:
deterministic algorithms with and without `fill_uninitialized_memory` (torch's default fills
every new tensor with NaN), clip_grad_norm_(inf) (the old way to measure the norm), the
health check's host reads, and one intra-op thread instead of one per core.
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Callable, Dict, List, Tuple

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests")]

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from data.dataset import normalize  # noqa: E402
from data.pipeline import build_datasets, build_loader  # noqa: E402
from data.sampler import BatchPlan, GlobalBatchSampler  # noqa: E402
from support.runs import compose_config  # noqa: E402
from train.model import build_model  # noqa: E402
from train.optim import build_optimizer  # noqa: E402

EXPERIMENT = ["+experiment=resnet", "logger=none", "checkpoint.enabled=false",
              "trainer.device=cpu", "trainer.log_every_steps=10"]
LOG_LINE = re.compile(r"^\[([\d-]+ [\d:,]+)\].*step (\d+)/\d+ ")


def ours(steps: int, warmup: int, run_root: Path, extra: List[str]) -> float:
    """Images/s of `python -m train` between the log lines of steps `warmup` and `steps`."""
    subprocess.run([sys.executable, "-m", "train", *EXPERIMENT, *extra,
                    f"trainer.max_steps={steps}", f"run.root={run_root}", "run.name=bench"],
                   cwd=REPO, check=True, capture_output=True)
    seen: Dict[int, datetime] = {}
    for line in (run_root / "bench" / "train.log").read_text().splitlines():
        match = LOG_LINE.match(line)
        if match:
            seen[int(match[2])] = datetime.strptime(match[1], "%Y-%m-%d %H:%M:%S,%f")
    seconds = (seen[steps] - seen[warmup]).total_seconds()
    return (steps - warmup) * global_batch_size() / seconds


def global_batch_size() -> int:
    return compose_config(EXPERIMENT).data.global_batch_size


def bare(steps: int, warmup: int, run_root: Path) -> float:
    """Images/s of forward / backward / step over our loader's batches in a new process."""
    out = subprocess.run([sys.executable, __file__, "--bare", str(steps), "--warmup",
                          str(warmup), "--run-root", str(run_root)],
                         cwd=REPO, check=True, capture_output=True, text=True).stdout
    return float(out.split()[-1])


def bare_loop(steps: int, warmup: int, run_root: Path) -> float:
    """The loop a tutorial writes: nothing but the step, torch's default settings."""
    cfg = compose_config([*EXPERIMENT, f"run.root={run_root}"])
    torch.manual_seed(cfg.seed)
    train_set, _ = build_datasets(cfg.data, cfg.seed)
    plan = BatchPlan(len(train_set), cfg.data.global_batch_size, 1, 1)
    loader = build_loader(train_set, GlobalBatchSampler(plan, cfg.seed, 0, 0, 0), cfg.data,
                          pin_memory=False)
    model = build_model(cfg.model, train_set.num_classes)
    optimizer = build_optimizer(cfg.optim, model)
    model.train()
    batches = iter(loader)
    for step in range(1, steps + 1):
        if step == warmup + 1:
            began = time.perf_counter()
        batch = next(batches)
        loss = F.cross_entropy(model(normalize(batch.images)), batch.labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return (steps - warmup) * cfg.data.global_batch_size / (time.perf_counter() - began)


def whole_loop(rounds: int, steps: int, warmup: int) -> None:
    runs: Dict[str, Callable[[Path], float]] = {
        "(a) ours": lambda root: ours(steps, warmup, root, []),
        "(b) ours, deterministic=false": lambda root: ours(
            steps, warmup, root, ["trainer.deterministic=false"]),
        "(c) bare loop": lambda root: bare(steps, warmup, root),
    }
    rates: Dict[str, List[float]] = {name: [] for name in runs}
    with tempfile.TemporaryDirectory(prefix="throughput-") as work:
        for r in range(rounds):
            order = list(runs) if r % 2 == 0 else list(reversed(runs))
            for name in order:
                rates[name].append(runs[name](Path(work) / f"{r}-{name[1]}"))
            print(f"round {r}: " + ", ".join(f"{name} {rates[name][-1]:.1f}"
                                             for name in runs) + " img/s; (a)/(c) "
                  f"{rates['(a) ours'][-1] / rates['(c) bare loop'][-1]:.3f}", flush=True)
    for name, values in rates.items():
        print(f"{name:32s} median {statistics.median(values):6.1f} img/s")
    for name in ("(a) ours", "(b) ours, deterministic=false"):
        ratios = [a / c for a, c in zip(rates[name], rates["(c) bare loop"])]
        print(f"{name[:3]}/(c) median of rounds {statistics.median(ratios):.3f} (rounds: "
              f"{' '.join(f'{x:.3f}' for x in ratios)})" + ("   target >= 0.97"
                                                            if name == "(a) ours" else ""))


def step_items(rounds: int) -> None:
    """Part 2: the compute-only step alone and with each item, interleaved step by step."""
    cfg = compose_config(EXPERIMENT)
    torch.manual_seed(0)
    size, batch = cfg.data.image_size, cfg.data.global_batch_size
    images, labels = torch.randn(batch, 3, size, size), torch.randint(0, 10, (batch,))
    model = build_model(cfg.model, 10)
    optimizer = build_optimizer(cfg.optim, model)
    cores = torch.get_num_threads()

    def step(item: str) -> Tuple[float, float]:
        torch.use_deterministic_algorithms(item.startswith("deterministic"))
        torch.utils.deterministic.fill_uninitialized_memory = "NaN" in item
        torch.set_num_threads(1 if item == "1 intra-op thread" else cores)
        wall, cpu = time.perf_counter(), time.process_time()
        loss = F.cross_entropy(model(images), labels)
        loss.backward()
        if item == "clip_grad_norm_(inf)":
            torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))
        if item == "norm + host reads":
            norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
            float(loss.detach()), float(norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return time.perf_counter() - wall, time.process_time() - cpu

    items = ["bare step", "deterministic, NaN fill (torch's default)",
             "deterministic, no fill (ours)", "clip_grad_norm_(inf)", "norm + host reads",
             "1 intra-op thread"]
    seconds: Dict[str, List[Tuple[float, float]]] = {item: [] for item in items}
    for item in items:  # warm-up
        step(item)
    for r in range(rounds):
        for item in (items if r % 2 == 0 else list(reversed(items))):
            seconds[item].append(step(item))
    print(f"\ncompute-only step, batch {batch} at {size} px, {rounds} interleaved steps each, "
          f"{cores} intra-op threads unless said; wall and process CPU time, ratios to the "
          f"bare step of the same round (median over rounds):")
    for item in items:
        wall = statistics.median(w for w, _ in seconds[item])
        cpu = statistics.median(c for _, c in seconds[item])
        wall_ratio = statistics.median(w / b for (w, _), (b, _)
                                       in zip(seconds[item], seconds["bare step"]))
        cpu_ratio = statistics.median(c / b for (_, c), (_, b)
                                      in zip(seconds[item], seconds["bare step"]))
        print(f"{item:42s} wall {wall * 1000:7.1f} ms ({batch / wall:5.1f} img/s, "
              f"x{wall_ratio:.3f})  CPU {cpu * 1000:7.1f} ms (x{cpu_ratio:.3f})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--step-rounds", type=int, default=20)
    parser.add_argument("--part", choices=["all", "loop", "step"], default="all")
    parser.add_argument("--bare", type=int, help=argparse.SUPPRESS)  # (c)'s own process
    parser.add_argument("--run-root", type=Path, help=argparse.SUPPRESS)
    opts = parser.parse_args()
    if opts.bare:
        print(bare_loop(opts.bare, opts.warmup, opts.run_root))
        return
    if opts.part in ("all", "loop"):
        whole_loop(opts.rounds, opts.steps, opts.warmup)
    if opts.part in ("all", "step"):
        step_items(opts.step_rounds)


if __name__ == "__main__":
    main()

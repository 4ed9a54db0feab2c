"""Training throughput: our loop against a bare loop over the same batches, side by side.

    python benchmarks/train_throughput.py [--rounds 4] [--steps 40]   # about 12 minutes
    python benchmarks/train_throughput.py --part loop --reference vision/references/classification

Part 1, the whole loop. Each round runs, in alternating order:
  (a) ours: `python -m train +experiment=resnet` (ResNet-18, the shapes dataset at 64 px,
      batches of 128, 2 loader workers, AdamW), checkpoints and MLflow off;
  (b) ours with `trainer.deterministic=false`;
  (c) a bare loop: the same model, optimizer and batches from our loader
      (`data.pipeline.build_loader`), forward / backward / step only, torch's defaults;
  (d) with `--reference DIR` (a checkout of torchvision's references/classification:
      `git clone --depth 1 https://github.com/pytorch/vision`, then
      `--reference vision/references/classification`), torchvision's reference recipe
      `train.py` on the same shapes dataset (`--data-path`), as close to (a) as its flags
      go: resnet18 with 10 classes, `--train-crop-size 64`, `-b 128`, `-j 2`, `--opt adamw`
      with our lr and weight decay, `--norm-weight-decay 0`, label smoothing 0 like ours,
      `--device cpu`, no `--amp`, one epoch, `--print-freq 1`. Without it the row is left
      out. Our files never include its code: it runs from the directory given.
Each is a fresh process; the rate is images over the wall time from the end of step
`--warmup` to the end of step `--steps` (for (a) and (b) read from the log lines'
timestamps, so logging, health checks and bookkeeping are inside it; for (d) the time its
MetricLogger line for each step arrives on its unbuffered stdout: the line for iteration
i is printed as step i + 1 ends, and the process is stopped once the line of step
`--steps` is in). Ratios are taken within a round (runs minutes apart on a shared machine
are not comparable), and the medians over rounds are printed.

What (d) does differently from (a), at the flags above (read from its train.py,
presets.py and utils.py):
  - Data: PIL decodes each JPEG and does RandomResizedCrop (bilinear; PIL's resize always
    filters, i.e. antialiases) with torchvision's default scale (0.08, 1) (ours 0.5 to 1,
    which keeps the shapes in view; the step's input is 64 px either way), a flip, then
    PILToTensor, ConvertImageDtype and Normalize in the worker: float32 batches, 4x the
    bytes of our uint8 ones through the workers' shared memory (ours decode with
    torchvision.io.decode_jpeg, crop with antialias on uint8 tensors and normalize in the
    loop). RandomSampler, DataLoader defaults (2 batches ahead per worker, ours 4;
    workers not persistent); `pin_memory=True`, a no-op without CUDA.
  - Step: forward, `zero_grad`, loss, backward, `optimizer.step()`; then top-1/top-5
    accuracy (a topk) and three host reads (`loss.item()`, `acc1.item()`,
    `acc5.item()`) every step, and a log line every `--print-freq` steps (here every
    step, so that steps `--warmup` and `--steps` have one; each costs a few medians over
    20 values). Ours reads the loss and the gradient norm (health check) every step.
  - Precision and layout: fp32; AMP only with `--amp` (CUDA autocast + GradScaler), left
    off, as ours runs fp32 on CPU (bf16 autocast on CUDA). No channels_last anywhere (ours
    only on CUDA). torch's default intra-op threads, like ours.
  - Determinism: `torch.backends.cudnn.benchmark = True` (no effect on CPU) and
    deterministic algorithms off unless `--use-deterministic-algorithms`; ours keeps them
    on (without the NaN fill, part 2): compare (d) with (b) as well as with (a).
  - Optimizer: AdamW(lr, wd) with norm layers undecayed (`--norm-weight-decay 0`); ours
    also exempts biases (only ResNet-18's fc.bias differs; newer versions' `--bias-weight-
    decay 0` would match it). Its lr changes per epoch, ours per step: no speed effect.
  - No checkpoints (it saves only at an epoch's end, after the timed window), like
    (a)'s checkpoint.enabled=false.

Part 2, what each item of a step costs, in one process: the compute-only step (synthetic
batch, same model and optimizer) alone and with one item added, interleaved step by step:
deterministic algorithms with and without `fill_uninitialized_memory` (torch's default fills
every new tensor with NaN), clip_grad_norm_(inf) (the old way to measure the norm), the
health check's host reads, and one intra-op thread instead of one per core.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import deque
from datetime import datetime
from pathlib import Path
from typing import Callable, Deque, Dict, List, Optional, Tuple

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests")]

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from data import synthetic  # noqa: E402
from data.dataset import normalize  # noqa: E402
from data.pipeline import build_datasets, build_loader  # noqa: E402
from data.sampler import BatchPlan, GlobalBatchSampler  # noqa: E402
from support.runs import compose_config  # noqa: E402
from train.learn.model import build_model  # noqa: E402
from train.learn.optim import build_optimizer  # noqa: E402

EXPERIMENT = ["+experiment=resnet", "logger=none", "checkpoint.enabled=false",
              "trainer.device=cpu", "trainer.log_every_steps=10"]
LOG_LINE = re.compile(r"^\[([\d-]+ [\d:,]+)\].*step (\d+)/\d+ ")
# MetricLogger.log_every's line for iteration i of the first epoch: "Epoch: [0]  [ i/N]  eta: ..."
REFERENCE_LINE = re.compile(r"^Epoch: \[0\]\s+\[\s*(\d+)/\d+\]")
REFERENCE = "(d) torchvision reference"
GET_REFERENCE = ("`git clone --depth 1 https://github.com/pytorch/vision`, then "
                 "`--reference vision/references/classification`")


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
    train_set, _ = build_datasets(cfg.data, cfg.seed, cfg.data.cache_dir)
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


def shapes_dataset() -> Path:
    """The dataset (a) to (c) train on, generated here if no run has made it yet."""
    data = compose_config(EXPERIMENT).data
    syn = data.synthetic
    return synthetic.generate(REPO / data.root, syn.num_train, syn.num_val, syn.size, syn.seed)


def reference_command(reference_dir: Path, dataset: Path, out: Path) -> List[str]:
    """torchvision's train.py with the flags nearest to our experiment (module docstring)."""
    cfg = compose_config(EXPERIMENT)
    size = cfg.data.image_size
    return [sys.executable, "-u", str(reference_dir / "train.py"), "--data-path", str(dataset),
            "--model", cfg.model.name, "--device", cfg.trainer.device.value,
            "--batch-size", str(cfg.data.global_batch_size),
            "--workers", str(cfg.data.num_workers), "--epochs", "1",
            "--opt", cfg.optim.name.value, "--lr", str(cfg.optim.lr),
            "--wd", str(cfg.optim.weight_decay), "--norm-weight-decay", "0",
            "--label-smoothing", str(cfg.trainer.label_smoothing),
            "--train-crop-size", str(size), "--val-crop-size", str(size),
            "--val-resize-size", str(int(size / 0.875)),  # our eval resize (data.dataset)
            "--print-freq", "1", "--output-dir", str(out)]


def reference(steps: int, warmup: int, reference_dir: Path, dataset: Path, work: Path) -> float:
    """Images/s of torchvision's train.py between the ends of steps `warmup` and `steps`: the
    arrival times of its per-step log lines. Stopped (its process group) once `steps` is
    logged, so its end-of-epoch evaluation and checkpoint never run."""
    work.mkdir(parents=True)
    ended: Dict[int, float] = {}
    tail: Deque[str] = deque(maxlen=20)
    with subprocess.Popen(reference_command(reference_dir, dataset, work), cwd=work,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          start_new_session=True) as proc:
        try:
            for line in proc.stdout:
                arrived = time.perf_counter()
                tail.append(line)
                match = REFERENCE_LINE.match(line)
                if match:
                    ended[int(match[1]) + 1] = arrived  # iteration i is step i + 1
                    if steps in ended:
                        break
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # its loader workers too
    if steps not in ended or warmup not in ended:
        raise RuntimeError(f"torchvision's train.py stopped before logging steps {warmup} and "
                           f"{steps}; its last lines:\n" + "".join(tail))
    return (steps - warmup) * global_batch_size() / (ended[steps] - ended[warmup])


def print_ratios(rates: Dict[str, List[float]], base: str) -> None:
    for name in ("(a) ours", "(b) ours, deterministic=false"):
        ratios = [a / c for a, c in zip(rates[name], rates[base])]
        target = "   target >= 0.97" if name == "(a) ours" and base == "(c) bare loop" else ""
        print(f"{name[:3]}/{base[:3]} median of rounds {statistics.median(ratios):.3f} (rounds: "
              f"{' '.join(f'{x:.3f}' for x in ratios)}){target}")


def whole_loop(rounds: int, steps: int, warmup: int, reference_dir: Optional[Path]) -> None:
    runs: Dict[str, Callable[[Path], float]] = {
        "(a) ours": lambda root: ours(steps, warmup, root, []),
        "(b) ours, deterministic=false": lambda root: ours(
            steps, warmup, root, ["trainer.deterministic=false"]),
        "(c) bare loop": lambda root: bare(steps, warmup, root),
    }
    if reference_dir is None:
        print(f"{REFERENCE} left out: {GET_REFERENCE}", flush=True)
    else:
        dataset = shapes_dataset()
        runs[REFERENCE] = lambda root: reference(steps, warmup, reference_dir, dataset, root)
    rates: Dict[str, List[float]] = {name: [] for name in runs}
    bases = [name for name in ("(c) bare loop", REFERENCE) if name in runs]
    with tempfile.TemporaryDirectory(prefix="throughput-") as work:
        for r in range(rounds):
            order = list(runs) if r % 2 == 0 else list(reversed(runs))
            for name in order:
                rates[name].append(runs[name](Path(work) / f"{r}-{name[1]}"))
            print(f"round {r}: " + ", ".join(f"{name} {rates[name][-1]:.1f}"
                                             for name in runs) + " img/s; " + ", ".join(
                f"(a)/{base[:3]} {rates['(a) ours'][-1] / rates[base][-1]:.3f}"
                for base in bases), flush=True)
    for name, values in rates.items():
        print(f"{name:32s} median {statistics.median(values):6.1f} img/s")
    for base in bases:
        print_ratios(rates, base)


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


def check_reference(parser: argparse.ArgumentParser, opts: argparse.Namespace) -> None:
    """(d) runs train.py from DIR for one epoch of the shapes dataset."""
    if not (opts.reference / "train.py").is_file():
        parser.error(f"--reference {opts.reference} has no train.py: pass the references/"
                     f"classification folder of a torchvision checkout ({GET_REFERENCE})")
    data = compose_config(EXPERIMENT).data
    epoch = data.synthetic.num_train // data.global_batch_size
    if opts.steps > epoch:
        parser.error(f"--steps {opts.steps} is more than one epoch of the shapes dataset "
                     f"({epoch} steps), all that (d) runs: pass --steps {epoch} or fewer")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--step-rounds", type=int, default=20)
    parser.add_argument("--part", choices=["all", "loop", "step"], default="all")
    parser.add_argument("--reference", type=Path, metavar="DIR",
                        help="torchvision's references/classification, for row (d): "
                             + GET_REFERENCE.replace("`", ""))
    parser.add_argument("--bare", type=int, help=argparse.SUPPRESS)  # (c)'s own process
    parser.add_argument("--run-root", type=Path, help=argparse.SUPPRESS)
    opts = parser.parse_args()
    if opts.bare:
        print(bare_loop(opts.bare, opts.warmup, opts.run_root))
        return
    if opts.reference is not None:
        check_reference(parser, opts)
    if opts.part in ("all", "loop"):
        whole_loop(opts.rounds, opts.steps, opts.warmup, opts.reference)
    if opts.part in ("all", "step"):
        step_items(opts.step_rounds)


if __name__ == "__main__":
    main()

"""How long does a checkpoint block training? ResNet-50 + AdamW state, side by side.

    python benchmarks/checkpoint_stall.py

One run measures, interleaved (a warm-up round, then the median of `--repeats` rounds):

  (a) `torch.save` of the full state (model + optimizer) to a file; (a') the same, fsynced
      (a checkpoint must survive a crash, and DCP fsyncs its files)
  (b) synchronous DCP         (CheckpointManager, checkpoint.async_mode=off)
  (c) async DCP, thread       (checkpoint.async_mode=thread)
  (d) async DCP, process      (checkpoint.async_mode=process)
  (e) the limit: one in-memory copy of every tensor of the state

as the time the caller is blocked, and for (b)-(d) the total time until the checkpoint is
committed (written, checksummed, marked, renamed). Then the total save time at 1 vs 2 ranks
(`torchrun --standalone`, gloo, each rank holding a replica; DCP de-duplicates replicated
tensors, so each rank writes about half), and the step-time overhead of checkpointing every
5 steps in a real `python -m train` run (interleaved runs with and without, the best of
each: other processes on a shared machine only ever slow a run down).

This file is run as a script (not `-m`): the process-based saver and torchrun start it
again in new processes.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
import torchvision

from checkpointing.manager import CheckpointManager, CheckpointOptions
from train.distributed import init_world, shutdown_world
from train.state import ModelState, OptimizerState

MODES = {"b": "off", "c": "thread", "d": "process"}
LABELS = {"a": "torch.save, full state", "a'": "torch.save + fsync", "b": "DCP synchronous",
          "c": "DCP async, thread", "d": "DCP async, process", "e": "limit: one memory copy"}
TRAIN_STEPS, TRAIN_BATCH, TRAIN_ROUNDS = 60, 64, 2


def build_state() -> Tuple[torch.nn.Module, torch.optim.Optimizer]:
    """ResNet-50 with AdamW after one step, so exp_avg / exp_avg_sq exist (3x the params)."""
    torch.manual_seed(0)  # every rank builds the same replica
    model = torchvision.models.get_model("resnet50", num_classes=1000)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loss = F.cross_entropy(model(torch.randn(2, 3, 64, 64)), torch.tensor([0, 1]))
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return model, optimizer


def state_tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer
                  ) -> List[torch.Tensor]:
    return [*model.state_dict().values(),
            *(v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v))]


def memory_copy(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Dict[str, Any]:
    """The least any consistent snapshot must do: copy every tensor once."""
    return {"model": {k: v.clone() for k, v in model.state_dict().items()},
            "optim": {pid: {k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()}
                      for pid, s in optimizer.state.items()}}


def torch_save(obj: Any, path: Path, durable: bool) -> None:
    with open(path, "wb") as f:
        torch.save(obj, f)
        if durable:
            f.flush()
            os.fsync(f.fileno())


def timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure_stalls(work: Path, repeats: int) -> Tuple[Dict[str, Dict[str, float]], float]:
    """{label: {"blocked": s, "total": s}} medians over `repeats` interleaved rounds, and
    the state's size in MB."""
    world = init_world(torch.device("cpu"))  # a 1-rank gloo group: async_mode=process needs one
    model, optimizer = build_state()
    state_mb = sum(t.numel() * t.element_size() for t in state_tensors(model, optimizer)) / 1e6
    state = {"model": ModelState(model), "optim": OptimizerState(model, optimizer)}
    managers = {key: CheckpointManager(CheckpointOptions(dir=str(work / mode), async_mode=mode,
                                                         keep_last=2),
                                       world.rank, world.world_size, world.control_group)
                for key, mode in MODES.items()}
    samples: Dict[str, Dict[str, List[float]]] = {
        k: {"blocked": [], "total": []} for k in LABELS}
    for round_ in range(repeats + 1):  # round 0 warms up (process start, page cache)
        step = round_ + 1
        full = work / "torch_save.pt"
        plain = {"model": model.state_dict(), "optim": optimizer.state_dict()}
        results = {"a": (timed(lambda: torch_save(plain, full, durable=False)),) * 2,
                   "a'": (timed(lambda: torch_save(plain, full, durable=True)),) * 2,
                   "e": (timed(lambda: memory_copy(model, optimizer)),) * 2}
        for key, manager in managers.items():
            start = time.perf_counter()
            manager.save(step, state)
            blocked = time.perf_counter() - start
            if not manager.wait():
                raise RuntimeError(f"the {MODES[key]} save failed: see the log above")
            results[key] = (blocked, time.perf_counter() - start)
        full.unlink()
        if round_:
            for key, (blocked, total) in results.items():
                samples[key]["blocked"].append(blocked)
                samples[key]["total"].append(total)
        print(f"  round {round_}{' (warm-up)' if not round_ else ''}: " + "  ".join(
            f"({k}) {results[k][0]:.3f}s" for k in LABELS), flush=True)
    shutdown_world()
    return {k: {kind: statistics.median(v) for kind, v in s.items()}
            for k, s in samples.items()}, state_mb


def ranks_worker(work: Path, repeats: int) -> None:
    """Under torchrun: every rank saves the same replicated state; rank 0 reports."""
    world = init_world(torch.device("cpu"))
    model, optimizer = build_state()
    state = {"model": ModelState(model), "optim": OptimizerState(model, optimizer)}
    manager = CheckpointManager(CheckpointOptions(dir=str(work), async_mode="off", keep_last=2),
                                world.rank, world.world_size, world.control_group)
    times = []
    for step in range(1, repeats + 2):
        dist.barrier(group=world.control_group)
        # Synchronous: rank 0's save returns once every rank's marker is in and it renamed.
        elapsed = timed(lambda: manager.save(step, state))
        if step > 1:
            times.append(elapsed)
    dist.barrier(group=world.control_group)
    if world.rank == 0:
        last = work / f"step_{repeats + 1:09d}"
        per_rank = [sum(p.stat().st_size for p in last.glob(f"__{r}_*.distcp"))
                    for r in range(world.world_size)]
        print("RESULT " + json.dumps({"ranks": world.world_size,
                                      "save_s": statistics.median(times),
                                      "bytes_per_rank": per_rank}), flush=True)
    shutdown_world()


def measure_ranks(work: Path, repeats: int) -> List[Dict[str, Any]]:
    results = []
    for ranks in (1, 2):
        out = work / f"ranks{ranks}"
        proc = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone",
             f"--nproc-per-node={ranks}", __file__, "--ranks-worker", str(out),
             "--repeats", str(repeats)],
            capture_output=True, text=True, timeout=300,
            env=dict(os.environ, OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 2) // ranks))))
        found = re.search(r"^RESULT (.*)$", proc.stdout, re.MULTILINE)
        if proc.returncode or not found:
            raise RuntimeError(f"torchrun with {ranks} rank(s) failed:\n{proc.stderr[-3000:]}")
        results.append(json.loads(found.group(1)))
        shutil.rmtree(out, ignore_errors=True)
    return results


def measure_training(work: Path, interval: int) -> Dict[str, Dict[str, float]]:
    """`python -m train` without and with checkpoints every `interval` steps: the best
    run of each; a kind whose runs all failed is left out (the failures are printed)."""
    data = work / "shapes"
    subprocess.run([sys.executable, "-m", "data.synthetic", "--out", str(data), "--num-train",
                    str(TRAIN_STEPS * TRAIN_BATCH + 200), "--num-val", "200", "--size", "96"],
                   check=True, capture_output=True)
    common = ["+experiment=resnet", f"data.root={data}", f"data.global_batch_size={TRAIN_BATCH}",
              "logger=none", f"trainer.max_steps={TRAIN_STEPS}",
              # one metrics window over the whole run: its images/s includes every stall
              f"trainer.log_every_steps={TRAIN_STEPS}", f"run.root={work / 'runs'}"]
    every = f"checkpoint.interval_steps={interval}"
    runs = {"no checkpoints": ["run.name=off", "checkpoint.enabled=false"],
            "thread": ["run.name=thread", every, "checkpoint.async_mode=thread"],
            "process": ["run.name=process", every, "checkpoint.async_mode=process"]}
    results: Dict[str, Dict[str, float]] = {}
    for round_ in range(TRAIN_ROUNDS):
        for label, extra in runs.items():
            shutil.rmtree(work / "runs", ignore_errors=True)  # a fresh run, not a resume
            start = time.perf_counter()
            proc = subprocess.run([sys.executable, "-m", "train", *common, *extra], cwd=work,
                                  capture_output=True, text=True, timeout=600)
            wall = time.perf_counter() - start
            rate = re.findall(r"train/images_per_second=([\d.e+]+)", proc.stdout + proc.stderr)
            if proc.returncode or not rate:
                # The trainer is shared with work in progress: report the failure, go on.
                print(f"  round {round_}, {label}: python -m train failed, rc="
                      f"{proc.returncode}:\n{(proc.stdout + proc.stderr)[-1500:]}", flush=True)
                continue
            best = results.setdefault(label, {"images_per_second": 0.0, "wall_s": float("inf")})
            best["images_per_second"] = max(best["images_per_second"], float(rate[-1]))
            best["wall_s"] = min(best["wall_s"], wall)
            print(f"  round {round_}, {label}: {float(rate[-1]):.1f} images/s, {wall:.1f}s "
                  f"wall", flush=True)
    return results


def report(stalls: Dict[str, Dict[str, float]], ranks: List[Dict[str, Any]],
           training: Dict[str, Dict[str, float]], state_mb: float,
           repeats: int, interval: int) -> None:
    # The machine may be shared: the load average says how much to trust small differences.
    print(f"\nResNet-50 + AdamW state: {state_mb:.1f} MB; median of {repeats} rounds after a "
          f"warm-up; torch {torch.__version__}, {os.cpu_count()} CPU cores, load average "
          f"{os.getloadavg()[0]:.1f}")
    print(f"{'':32} {'blocked (s)':>12} {'until committed (s)':>20}")
    for key, label in LABELS.items():
        total = f"{stalls[key]['total']:.3f}" if key in MODES else ""
        print(f"{'(' + key + ')':4} {label:27} {stalls[key]['blocked']:12.3f} {total:>20}")
    blocked = {k: v["blocked"] for k, v in stalls.items()}
    print("ratios (blocked): " + "  ".join(
        f"({x})/({y}) = {blocked[x] / blocked[y]:.3f}"
        for x, y in [("c", "a"), ("d", "a"), ("c", "e"), ("d", "e"), ("c", "a'"),
                     ("d", "a'")]))
    print("\ntotal save time (synchronous DCP, until committed), same replicated state:")
    for r in ranks:
        shares = ", ".join(f"{b / 1e6:.0f}" for b in r["bytes_per_rank"])
        print(f"  {r['ranks']} rank(s): {r['save_s']:.3f}s  (MB written per rank: {shares})")
    print(f"  2 ranks / 1 rank = {ranks[1]['save_s'] / ranks[0]['save_s']:.2f}")
    if "no checkpoints" in training:
        off = training["no checkpoints"]
        print(f"\npython -m train, ResNet-18 + AdamW, {TRAIN_STEPS} steps of {TRAIN_BATCH} images "
              f"at 64 px, a checkpoint every {interval} steps (async thread or process) "
              f"vs none; best of {TRAIN_ROUNDS} interleaved runs each:")
        for label, r in training.items():
            overhead = ("" if r is off else f"  step-time overhead "
                        f"{off['images_per_second'] / r['images_per_second'] - 1:+.1%}, wall "
                        f"time ratio {r['wall_s'] / off['wall_s']:.3f}")
            print(f"  {label:15} {r['images_per_second']:7.1f} images/s  {r['wall_s']:6.1f}s "
                  f"wall (process start to exit){overhead}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="measured rounds per method")
    parser.add_argument("--skip-training", action="store_true",
                        help="leave out the `python -m train` runs")
    parser.add_argument("--train-interval", type=int, default=5,
                        help="checkpoint.interval_steps of the training runs")
    parser.add_argument("--ranks-worker", type=Path, metavar="DIR", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.ranks_worker:
        ranks_worker(args.ranks_worker, args.repeats)
        return
    work = Path(tempfile.mkdtemp(prefix="checkpoint-stall-"))
    try:
        started = time.perf_counter()
        print("stall per save, interleaved rounds:", flush=True)
        stalls, state_mb = measure_stalls(work, args.repeats)
        print("1 vs 2 ranks (torchrun) ...", flush=True)
        ranks = measure_ranks(work, args.repeats)
        training: Dict[str, Dict[str, float]] = {}
        if not args.skip_training:
            print("training runs ...", flush=True)
            training = measure_training(work, args.train_interval)
        report(stalls, ranks, training, state_mb, args.repeats, args.train_interval)
        print(f"\n(benchmark took {time.perf_counter() - started:.0f}s)")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()

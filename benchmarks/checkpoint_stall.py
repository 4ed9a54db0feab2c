"""How long does a checkpoint block training? ResNet-50 + AdamW state, side by side.

    python benchmarks/checkpoint_stall.py
    python benchmarks/checkpoint_stall.py --profile off    # cProfile of a save, top lines

One run measures, interleaved (a warm-up round, then the median of `--repeats` rounds):

  (a) `torch.save` of the full state (model + optimizer) to a file; (a') the same, fsynced
      (a checkpoint must survive a crash, and DCP fsyncs its files)
  (b) synchronous DCP         (CheckpointManager, checkpoint.async_mode=off)
  (c) async DCP, thread       (checkpoint.async_mode=thread)
  (d) async DCP, process      (checkpoint.async_mode=process)
  (f) synchronous DCP in checkpoint.format=raw (the others: the default, DCP's standard
      format)
  (e) the limit: one `copy_` of every tensor into preallocated (warm) buffers;
      (e') the same into fresh memory (`clone()`), page faults included

as the time the caller is blocked, and for (b)-(d), (f) the total time until the checkpoint
is committed (written, checksummed, fsynced, marked, renamed). "Back to back" is the blocked
time of a save issued right after another one (it waits for the first to commit), and
"stall" what `CheckpointManager.save` itself reports (the loop's
`checkpoint/stall_seconds`). In the same rounds, the resume read of the same state into the
live model and optimizer: (r) `torch.load` of (a)'s file + `load_state_dict`; (s) what a
resume does with the checkpoint (b) just wrote, verified (checksums, `.metadata` through the
restricted unpickler) and loaded by a new CheckpointManager, (s') the same for (f)'s; and (t)
DCP's stock `dcp.load` of (b)'s with the default reader and planner (unverified). Then the
marker checksums' throughput on the same bytes
(sha256, CRC32C, XXH3-64), the total save time at 1 vs 2 ranks (`torchrun --standalone`,
gloo, each rank holding a replica; DCP de-duplicates replicated tensors, so each rank
writes about half), and the training overhead of checkpointing the default experiment every
N steps (`--train-intervals`): interleaved `python -m train` runs with and without, medians.

This file is run as a script (not `-m`): the process-based saver and torchrun start it
again in new processes.
"""

from __future__ import annotations

import argparse
import cProfile
import hashlib
import json
import os
import pstats
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
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
import torchvision
import xxhash
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from checkpointing.manager import CheckpointManager, CheckpointOptions
from train.cluster.world import init_world, shutdown_world
from train.resume.stateful import ModelState, OptimizerState

# (checkpoint.async_mode, checkpoint.format) of each CheckpointManager row
MODES = {"b": ("off", "dcp"), "c": ("thread", "dcp"), "d": ("process", "dcp"),
         "f": ("off", "raw")}
LABELS = {"a": "torch.save, full state", "a'": "torch.save + fsync", "b": "DCP synchronous",
          "c": "DCP async, thread", "d": "DCP async, process",
          "f": "DCP synchronous, format=raw",
          "e": "limit: copy_ into warm memory", "e'": "copy into fresh memory"}
LOAD_LABELS = {"r": "torch.load + load_state_dict",
               "s": "resume read (verified), dcp",
               "s'": "resume read (verified), raw",
               "t": "stock dcp.load (unverified)"}
TRAIN_BATCH = 128  # the default experiment's


def build_state(name: str = "resnet50") -> Tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A torchvision model (ResNet-50 unless named) with AdamW after one step, so exp_avg /
    exp_avg_sq exist (3x the params)."""
    torch.manual_seed(0)  # every rank builds the same replica
    model = torchvision.models.get_model(name, num_classes=1000)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    side = 224 if name.startswith("vit") else 64  # a ViT takes its image size only
    loss = F.cross_entropy(model(torch.randn(2, 3, side, side)), torch.tensor([0, 1]))
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return model, optimizer


def state_tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer
                  ) -> List[torch.Tensor]:
    return [*model.state_dict().values(),
            *(v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v))]


def copy_into(buffers: List[torch.Tensor], tensors: List[torch.Tensor]) -> None:
    """The least any consistent snapshot must do: copy every tensor once, into memory
    that is already there."""
    for buffer, tensor in zip(buffers, tensors):
        buffer.copy_(tensor)


def torch_save(obj: Any, path: Path, durable: bool) -> None:
    with open(path, "wb") as f:
        torch.save(obj, f)
        if durable:
            f.flush()
            os.fsync(f.fileno())


def torch_load(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """The plain way back: one file into the live model and optimizer."""
    state = torch.load(path, weights_only=True)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optim"])


# The saves whose checkpoint is read back, and the row that times it
LOADED = {"b": "s", "f": "s'"}


def resume(manager: CheckpointManager, state: Dict[str, Any], step: int) -> None:
    """What a resume reads: the newest checkpoint, verified (checksums, `.metadata` through
    the restricted unpickler), loaded into the live model and optimizer by a new manager."""
    options = manager.options
    fresh = CheckpointManager(options, manager.rank, manager.world_size, manager.group)
    loaded = fresh.load_latest(state)
    if loaded is None or loaded.step != step:
        raise RuntimeError(f"resuming from {options.dir} found {loaded}, not step {step}")


def stock_load(directory: Path, step: int, model: torch.nn.Module,
               optimizer: torch.optim.Optimizer) -> None:
    """DCP's stock reader and planner, as a user without this project would load it (no
    checksums, and `.metadata` unpickled by plain pickle)."""
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=str(directory / f"step_{step:09d}"), no_dist=True)
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])


def timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def timed_with_cpu(fn: Callable[[], Any]) -> Dict[str, float]:
    """Wall seconds ("blocked") and this process's CPU seconds, all threads ("cpu"): on a
    shared machine the CPU time says what the work costs, the wall time also how long the
    scheduler made it wait."""
    cpu = time.process_time()
    blocked = timed(fn)
    return {"blocked": blocked, "cpu": time.process_time() - cpu}


def checksum_functions() -> Dict[str, Callable[[List[memoryview]], Any]]:
    """Each algorithm over a list of buffers, as the writer would feed it. google-crc32c
    only takes `bytes`, so each memoryview costs it a copy (measured: it is what the writer
    would have to do); it is a benchmark-only dependency, left out when not installed."""
    def sha256(views: List[memoryview]) -> str:
        digest = hashlib.sha256()
        for view in views:
            digest.update(view)
        return digest.hexdigest()

    def xxh3_64(views: List[memoryview]) -> str:
        digest = xxhash.xxh3_64()
        for view in views:
            digest.update(view)
        return digest.hexdigest()

    functions = {"sha256": sha256, "xxh3_64": xxh3_64}
    try:
        import google_crc32c
    except ImportError:
        return functions

    def crc32c(views: List[memoryview]) -> int:
        crc = 0
        for view in views:
            crc = google_crc32c.extend(crc, bytes(view))
        return crc

    functions["crc32c"] = crc32c
    return functions


def measure_checksums(tensors: List[torch.Tensor], repeats: int) -> Dict[str, float]:
    """GB/s of each checksum over the state's bytes: interleaved rounds, medians."""
    views = [memoryview(t.detach().contiguous().numpy()).cast("B") for t in tensors]
    total = sum(v.nbytes for v in views)
    functions = checksum_functions()
    samples: Dict[str, List[float]] = {name: [] for name in functions}
    for _ in range(repeats):
        for name, fn in functions.items():
            samples[name].append(total / timed(lambda: fn(views)) / 1e9)
    return {name: statistics.median(v) for name, v in samples.items()}


def save_back_to_back(manager: CheckpointManager, step: int, state: Dict[str, Any]
                      ) -> Tuple[float, float]:
    """(seconds blocked, what `save` reported) for a save issued while the previous one is
    still in flight: the loop waits for it, and the stall must say so."""
    manager.save(step, state)
    start = time.perf_counter()
    reported = manager.save(step + 1, state).stall_seconds
    blocked = time.perf_counter() - start
    if not manager.wait():
        raise RuntimeError("a back-to-back save failed: see the log above")
    return blocked, reported


def remove_checkpoints(directory: Path) -> None:
    for step_dir in directory.glob("step_*"):
        shutil.rmtree(step_dir)


def keep_round(samples: Dict[str, Dict[str, List[float]]], results: Dict[str, Dict[str, float]],
               round_: int, name: str, labels: Dict[str, str]) -> None:
    """Keep a measured round's figures (round 0 is the warm-up) and print its blocked times."""
    if round_:
        for key, values in results.items():
            for kind, value in values.items():
                samples[key].setdefault(kind, []).append(value)
    print(f"  {name} {round_}{' (warm-up)' if not round_ else ''}: " + "  ".join(
        f"({k}) {results[k]['blocked']:.3f}s" for k in labels if k in results), flush=True)


def measure_stalls(work: Path, repeats: int, model_name: str = "resnet50",
                   modes: Dict[str, Tuple[str, str]] = MODES
                   ) -> Tuple[Dict[str, Dict[str, float]], float]:
    """{label: {"blocked": s, "total": s, ...}} medians over `repeats` interleaved rounds,
    and the state's size in MB; DCP saves in `modes` (a subset of MODES)."""
    world = init_world(torch.device("cpu"))  # a 1-rank gloo group: async_mode=process needs one
    model, optimizer = build_state(model_name)
    tensors = state_tensors(model, optimizer)
    state_mb = sum(t.numel() * t.element_size() for t in tensors) / 1e6
    buffers = [torch.empty_like(t) for t in tensors]
    copy_into(buffers, tensors)  # warm: every page is touched once, before any timing
    state = {"model": ModelState(model), "optim": OptimizerState(model, optimizer)}
    # Retention never deletes during a timed save (keep_last above the saves made): deleting
    # an older checkpoint is not part of committing this one, and (a') deletes nothing. The
    # old checkpoints are removed between saves, untimed.
    managers = {key: CheckpointManager(
        CheckpointOptions(dir=str(work / key), async_mode=mode, keep_last=1000, format=fmt),
        world.rank, world.world_size, world.control_group) for key, (mode, fmt) in modes.items()}
    loaded = {key: label for key, label in LOADED.items() if key in modes}
    samples: Dict[str, Dict[str, List[float]]] = {
        k: {} for k in {**LABELS, **LOAD_LABELS}
        if (k in LABELS and (k not in MODES or k in modes)) or (loaded and k in LOAD_LABELS)}
    step = 0
    for round_ in range(repeats + 1):  # round 0 warms up (process start, page cache)
        full = work / "torch_save.pt"
        plain = {"model": model.state_dict(), "optim": optimizer.state_dict()}
        results = {"a": timed_with_cpu(lambda: torch_save(plain, full, durable=False)),
                   "a'": timed_with_cpu(lambda: torch_save(plain, full, durable=True)),
                   "e": timed_with_cpu(lambda: copy_into(buffers, tensors)),
                   "e'": timed_with_cpu(lambda: [t.clone() for t in tensors])}
        for key, manager in managers.items():
            step += 3
            start, cpu = time.perf_counter(), time.process_time()
            reported = manager.save(step, state).stall_seconds
            blocked = time.perf_counter() - start
            if not manager.wait():
                raise RuntimeError(f"the {LABELS[key]} save failed: see the log above")
            total, cpu = time.perf_counter() - start, time.process_time() - cpu
            remove_checkpoints(work / key)
            again, again_reported = save_back_to_back(manager, step + 1, state)
            remove_checkpoints(work / key)
            results[key] = {"blocked": blocked, "total": total, "cpu": cpu, "stall": reported,
                            "back_to_back": again, "back_to_back_stall": again_reported}
        full.unlink()
        keep_round(samples, results, round_, "round", LABELS)
    # The reads in rounds of their own: a load replaces live tensors (the optimizer's state),
    # which makes the next save check its state-dict shortcut again (train/resume/stateful.py).
    for round_ in range(repeats + 1 if loaded else 0):
        torch_save({"model": model.state_dict(), "optim": optimizer.state_dict()}, full,
                   durable=True)
        saved = {}
        for key in loaded:
            step += 1
            managers[key].save(step, state)
            if not managers[key].wait():
                raise RuntimeError(f"the {LABELS[key]} save failed: see the log above")
            saved[key] = step
        results = {"r": timed_with_cpu(lambda: torch_load(full, model, optimizer))}
        for key, label in loaded.items():
            results[label] = timed_with_cpu(lambda: resume(managers[key], state, saved[key]))
        if "b" in loaded:
            results["t"] = timed_with_cpu(lambda: stock_load(work / "b", saved["b"], model,
                                                             optimizer))
        for key in loaded:
            remove_checkpoints(work / key)
        full.unlink()
        keep_round(samples, results, round_, "read round", LOAD_LABELS)
    shutdown_world()
    return {k: {kind: statistics.median(v) for kind, v in s.items()}
            for k, s in samples.items()}, state_mb


def profile_saves(work: Path, mode: str, saves: int = 3, lines: int = 15) -> None:
    """cProfile of `saves` saves after a warm-up one, top `lines` by own time. For the async
    modes this is the loop's thread only: what blocks it."""
    world = init_world(torch.device("cpu"))
    model, optimizer = build_state()
    state = {"model": ModelState(model), "optim": OptimizerState(model, optimizer)}
    manager = CheckpointManager(CheckpointOptions(dir=str(work), async_mode=mode, keep_last=2),
                                world.rank, world.world_size, world.control_group)
    manager.save(1, state)
    manager.wait()
    profile = cProfile.Profile()
    for step in range(2, saves + 2):
        profile.enable()
        manager.save(step, state)
        if mode == "off":
            manager.wait()
        profile.disable()
        manager.wait()
    shutdown_world()
    print(f"cProfile of {saves} saves, checkpoint.async_mode={mode}, ResNet-50 + AdamW:")
    pstats.Stats(profile).sort_stats("tottime").print_stats(lines)


def synchronous_saves(work: Path, world: Any, state: Dict[str, Any], repeats: int
                      ) -> List[float]:
    """Under torchrun, every rank: seconds of `repeats` synchronous saves of `state` to
    `work` (steps 2 to repeats + 1; the first, untimed, allocates the staging buffers)."""
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
    return times


def ranks_worker(work: Path, repeats: int) -> None:
    """Under torchrun: every rank saves the same replicated state; rank 0 reports."""
    world = init_world(torch.device("cpu"))
    model, optimizer = build_state()
    state = {"model": ModelState(model), "optim": OptimizerState(model, optimizer)}
    times = synchronous_saves(work, world, state, repeats)
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


# The training runs log a window of metrics every LOG_EVERY steps, so each run gives the
# images/s of each window: the first holds the first save (buffers allocated), the last the
# final save, which the run waits for; the ones between are the steady state of a long run.
LOG_EVERY = 25


def measure_training(work: Path, steps: int, intervals: List[int], modes: List[str],
                     rounds: int) -> Dict[str, Dict[str, float]]:
    """`python -m train +experiment=resnet` for `steps` steps without checkpoints and with
    them every N steps of `intervals` in each async mode of `modes`: medians of `rounds`
    interleaved rounds of the whole run's images/s (every save counted, the final one
    included), of the steady-state windows' images/s and of the wall time. A kind whose
    runs all failed is left out (the failures are printed)."""
    data = work / "shapes"
    subprocess.run([sys.executable, "-m", "data.synthetic", "--out", str(data), "--num-train",
                    str(steps * TRAIN_BATCH + 200), "--num-val", "200", "--size", "96"],
                   check=True, capture_output=True)
    common = ["+experiment=resnet", f"data.root={data}", "logger=none",
              f"trainer.max_steps={steps}", f"trainer.log_every_steps={LOG_EVERY}",
              f"run.root={work / 'runs'}"]
    runs = {"no checkpoints": ["run.name=off", "checkpoint.enabled=false"]}
    for interval in intervals:
        for mode in modes:
            runs[f"{mode}, every {interval}"] = [
                f"run.name={mode}{interval}", f"checkpoint.interval_steps={interval}",
                f"checkpoint.async_mode={mode}"]
    samples: Dict[str, Dict[str, List[float]]] = {}
    by_round: List[Dict[str, Dict[str, float]]] = []  # each round's runs, for paired ratios
    for round_ in range(rounds):
        by_round.append({})
        # Every other round in reverse: a kind always run first (or last) in a round would
        # carry that position's bias (the first run in a round ran a few % slower here).
        order = list(runs.items()) if round_ % 2 == 0 else list(reversed(runs.items()))
        for label, extra in order:
            shutil.rmtree(work / "runs", ignore_errors=True)  # a fresh run, not a resume
            start = time.perf_counter()
            proc = subprocess.run([sys.executable, "-m", "train", *common, *extra], cwd=work,
                                  capture_output=True, text=True, timeout=1800)
            wall = time.perf_counter() - start
            rates = [float(r) for r in re.findall(r"train/images_per_second=([\d.e+]+)",
                                                  proc.stdout + proc.stderr)]
            if proc.returncode or len(rates) < 3:
                # The trainer is shared with work in progress: report the failure, go on.
                print(f"  round {round_}, {label}: python -m train failed, rc="
                      f"{proc.returncode}:\n{(proc.stdout + proc.stderr)[-1500:]}", flush=True)
                continue
            whole = len(rates) / sum(1 / r for r in rates)  # equal windows: harmonic mean
            steady = statistics.median(rates[1:-1])
            runs_of = samples.setdefault(label, {"whole": [], "steady": [], "wall_s": []})
            for kind, value in (("whole", whole), ("steady", steady), ("wall_s", wall)):
                runs_of[kind].append(value)
            by_round[-1][label] = {"whole": whole, "steady": steady}
            print(f"  round {round_}, {label}: {whole:.1f} images/s over the run, "
                  f"{steady:.1f} between the first and last windows, {wall:.1f}s wall",
                  flush=True)
    results = {label: {kind: statistics.median(v) for kind, v in values.items()}
               for label, values in samples.items()}
    # The overhead within each round (its two runs back to back) is firmer than the ratio of
    # medians when the machine's load drifts between rounds.
    for label in results:
        for kind in ("whole", "steady"):
            paired = [runs["no checkpoints"][kind] / runs[label][kind] - 1
                      for runs in by_round if label in runs and "no checkpoints" in runs]
            results[label][f"paired {kind}"] = paired
    return results


def report(stalls: Dict[str, Dict[str, float]], checksums: Dict[str, float],
           ranks: List[Dict[str, Any]], training: Dict[str, Dict[str, float]],
           state_mb: float, repeats: int, steps: int, rounds: int) -> None:
    # The machine may be shared: the load average says how much to trust small differences.
    print(f"\nResNet-50 + AdamW state: {state_mb:.1f} MB; median of {repeats} rounds after a "
          f"warm-up; torch {torch.__version__}, {os.cpu_count()} CPU cores, load average "
          f"{os.getloadavg()[0]:.1f}")
    print(f"{'':36} {'blocked (s)':>11} {'committed (s)':>13} {'CPU (s)':>7} "
          f"{'back to back (s)':>16} {'stall (s)':>9}")
    for key, label in LABELS.items():
        row = stalls[key]
        cells = ([f"{row['total']:.3f}", f"{row['back_to_back']:.3f}",
                  f"{row['back_to_back_stall']:.3f}"] if key in MODES else ["", "", ""])
        print(f"{'(' + key + ')':5} {label:30} {row['blocked']:11.3f} {cells[0]:>13} "
              f"{row['cpu']:7.3f} {cells[1]:>16} {cells[2]:>9}")
    blocked = {k: v["blocked"] for k, v in stalls.items()}
    print("ratios (blocked): " + "  ".join(
        f"({x})/({y}) = {blocked[x] / blocked[y]:.3f}"
        for x, y in [("c", "e"), ("d", "e"), ("c", "b"), ("d", "b"), ("c", "a'"),
                     ("d", "a'"), ("e'", "e")]))
    durable, durable_cpu = blocked["a'"], stalls["a'"]["cpu"]
    print("ratios (until committed / torch.save + fsync): " + "  ".join(
        f"({x}) = {stalls[x]['total'] / durable:.2f}" for x in MODES)
        + ";  CPU seconds: " + "  ".join(
        f"({x}) = {stalls[x]['cpu'] / durable_cpu:.2f}" for x in MODES)
        + "  (the CPU of DCP's process is not counted in (d))")
    base = stalls["r"]
    print(f"\nresume read of the same state into the live model and optimizer (a fresh "
          f"checkpoint, in the page cache):\n{'':36} {'wall (s)':>8} {'CPU (s)':>7} "
          f"{'/ (r) wall':>10} {'/ (r) CPU':>9}")
    for key, label in LOAD_LABELS.items():
        row = stalls[key]
        print(f"{'(' + key + ')':5} {label:30} {row['blocked']:8.3f} {row['cpu']:7.3f} "
              f"{row['blocked'] / base['blocked']:10.2f} {row['cpu'] / base['cpu']:9.2f}")
    print("\nchecksums over the state's bytes, GB/s (median of interleaved rounds): "
          + "  ".join(f"{name} {rate:.2f} ({rate / checksums['sha256']:.1f}x sha256)"
                      for name, rate in checksums.items()))
    if ranks:
        print("\ntotal save time (synchronous DCP, until committed), same replicated state:")
        for r in ranks:
            shares = ", ".join(f"{b / 1e6:.0f}" for b in r["bytes_per_rank"])
            print(f"  {r['ranks']} rank(s): {r['save_s']:.3f}s  (MB written per rank: {shares})")
        print(f"  2 ranks / 1 rank = {ranks[1]['save_s'] / ranks[0]['save_s']:.2f}")
    if "no checkpoints" in training:
        off = training["no checkpoints"]
        print(f"\npython -m train +experiment=resnet (ResNet-18 + AdamW), {steps} steps of "
              f"{TRAIN_BATCH} images at 64 px, a window every {LOG_EVERY} steps; median of "
              f"{rounds} interleaved rounds. Training overhead = images/s without checkpoints "
              f"/ with, - 1: over the whole run (first save's allocation and the final save's "
              f"wait included), and in the steady state (the windows between the first and "
              f"the last):")
        for label, r in training.items():
            overhead = ("" if r is off else
                        f"  overhead: whole run {off['whole'] / r['whole'] - 1:+.1%}, steady "
                        f"{off['steady'] / r['steady'] - 1:+.1%}, wall time ratio "
                        f"{r['wall_s'] / off['wall_s']:.3f}\n{'':20}paired within each "
                        f"round: whole run {_median_and_rounds(r['paired whole'])}, steady "
                        f"{_median_and_rounds(r['paired steady'])}")
            print(f"  {label:18} {r['whole']:7.1f} images/s ({r['steady']:.1f} steady) "
                  f"{r['wall_s']:6.1f}s wall (process start to exit){overhead}")


def _median_and_rounds(overheads: List[float]) -> str:
    rounds = " ".join(f"{o:+.1%}" for o in overheads)
    return f"{statistics.median(overheads):+.1%} (rounds {rounds})" if overheads else "n/a"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="measured rounds per method")
    parser.add_argument("--skip-training", action="store_true",
                        help="leave out the `python -m train` runs")
    parser.add_argument("--skip-ranks", action="store_true",
                        help="leave out the 1 vs 2 ranks comparison")
    parser.add_argument("--train-intervals", type=int, nargs="+", default=[25, 5],
                        help="checkpoint.interval_steps of the training runs")
    parser.add_argument("--train-rounds", type=int, default=4,
                        help="interleaved rounds of training runs")
    parser.add_argument("--train-steps", type=int, default=100,
                        help=f"trainer.max_steps of the training runs (at least "
                             f"{3 * LOG_EVERY}: a first, a steady and a last window)")
    parser.add_argument("--train-modes", nargs="+", default=["thread", "process"],
                        choices=["thread", "process"],
                        help="checkpoint.async_mode of the training runs")
    parser.add_argument("--profile", choices=sorted({mode for mode, _ in MODES.values()}),
                        help="only profile saves in this checkpoint.async_mode")
    parser.add_argument("--ranks-worker", type=Path, metavar="DIR", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.train_steps < 3 * LOG_EVERY:
        parser.error(f"--train-steps must be at least {3 * LOG_EVERY}")
    if args.ranks_worker:
        ranks_worker(args.ranks_worker, args.repeats)
        return
    work = Path(tempfile.mkdtemp(prefix="checkpoint-stall-"))
    try:
        if args.profile:
            profile_saves(work, args.profile)
            return
        started = time.perf_counter()
        print("stall per save, interleaved rounds:", flush=True)
        stalls, state_mb = measure_stalls(work, args.repeats)
        model, optimizer = build_state()
        checksums = measure_checksums(state_tensors(model, optimizer), args.repeats + 2)
        del model, optimizer
        ranks: List[Dict[str, Any]] = []
        if not args.skip_ranks:
            print("1 vs 2 ranks (torchrun) ...", flush=True)
            ranks = measure_ranks(work, args.repeats)
        training: Dict[str, Dict[str, float]] = {}
        if not args.skip_training:
            print("training runs ...", flush=True)
            training = measure_training(work, args.train_steps, args.train_intervals,
                                        args.train_modes, args.train_rounds)
        report(stalls, checksums, ranks, training, state_mb, args.repeats, args.train_steps,
               args.train_rounds)
        print(f"\n(benchmark took {time.perf_counter() - started:.0f}s)")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()

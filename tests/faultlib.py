"""Helpers of the multi-process fault tests: launch torchrun jobs in their own session,
find their worker processes by PID, read the audit ledger's surviving history."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional

from conftest import REPO, tiny_overrides, train_env

STEPS_PER_EPOCH, EPOCHS, NUM_TRAIN = 6, 2, 120  # tiny_overrides: 120 images, batches of 20
FINAL = f"step_{STEPS_PER_EPOCH * EPOCHS:09d}"


def train_args(tiny_root: Path, run_root: Path, *extra: str,
               strategy: str = "ddp") -> List[str]:
    """`-m train ...` for a small run whose every step is in the ledger. Dropout draws from
    the RNG, so a resume that got the RNG wrong shows in the weights."""
    return ["-m", "train", *tiny_overrides(tiny_root), "model=tiny_cnn", "model.dropout=0.3",
            f"strategy={strategy}", "strategy.timeout_seconds=20",
            "strategy.init_timeout_seconds=90", "logger=none", "trainer.device=cpu",
            "checkpoint.interval_steps=2",
            f"audit.ledger={run_root / 'ledger.jsonl'}", f"run.root={run_root}", "run.name=r",
            *extra]


def launch(prefix: List[str], args: List[str], fault: str = "",
           log: Optional[Path] = None, **env: str) -> subprocess.Popen:
    """Start a launcher (torchrun, or python itself) in a session of its own, as a job
    scheduler would (torchrun's workers then start sessions of their own: `kill_node` kills
    an agent with its workers). `env`: more environment variables."""
    env = train_env(**({"GOODPUT_FAULT": fault} if fault else {}), **env)
    out = open(log, "a") if log else subprocess.PIPE
    return subprocess.Popen([*prefix, *args], cwd=REPO, env=env, stdout=out,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def finish(proc: subprocess.Popen, timeout: float = 300) -> str:
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(f"timed out after {timeout}s:\n{(out or '')[-4000:]}")
    return out or ""


def run_job(prefix: List[str], args: List[str], fault: str = "", expect: int = 0,
            timeout: float = 300) -> str:
    proc = launch(prefix, args, fault)
    out = finish(proc, timeout)
    assert proc.returncode == expect, f"exit {proc.returncode}, expected {expect}:\n" + out[-5000:]
    return out


def worker_pids(run_root: Path) -> Dict[int, int]:
    """{rank: pid} of the live trainer processes of the run under `run_root`, found by their
    command line and the RANK torchrun gave them (their data-loader workers, forked children
    with the same command line, are left out)."""
    candidates: Dict[int, tuple] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
            environ = dict(kv.split(b"=", 1) for kv in (entry / "environ").read_bytes()
                           .split(b"\0") if b"=" in kv)
            stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, ValueError):
            continue
        if (f"run.root={run_root}".encode() in cmdline and b"torch.distributed.run" not in
                cmdline and b"RANK" in environ and stat[0] != "Z"):
            candidates[int(entry.name)] = (int(environ[b"RANK"]), int(stat[1]))
    return {rank: pid for pid, (rank, parent) in candidates.items() if parent not in candidates}


def descendants(pid: int) -> List[int]:
    """Every live process below `pid` (torchrun's workers start sessions of their own, so
    killing the agent's process group leaves them running)."""
    children: Dict[int, List[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(parent, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def kill_node(agent: subprocess.Popen) -> None:
    """SIGKILL a torchrun agent and all its workers at once: a node is gone."""
    victims = [agent.pid, *descendants(agent.pid)]
    for pid in victims:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    agent.wait()


def wait_for(condition: Callable[[], bool], what: str, timeout: float = 120,
             proc: Optional[subprocess.Popen] = None) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the job ended (exit {proc.returncode}) before {what}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def ledger_records(ledger: Path) -> List[dict]:
    """Every complete line, in file order."""
    if not ledger.exists():
        return []
    records = []
    for line in ledger.read_bytes().splitlines(keepends=True):
        if line.endswith(b"\n") and line.strip():
            try:
                records.append(json.loads(line))
            except ValueError:
                continue
    return records


def surviving_history(ledger: Path) -> Dict[int, List[dict]]:
    """{step: the records of the attempt that recorded it last, one per rank}: a step done
    again after a crash (maybe at another world size) replaces the earlier records."""
    last: Dict[int, Dict[int, dict]] = {}
    for record in ledger_records(ledger):
        step, rank, world = record["step"], record["rank"], record["world"]
        ranks = last.setdefault(step, {})
        if any(r["world"] != world for r in ranks.values()):
            ranks.clear()  # the step was redone at another world size
        ranks[rank] = record
    return {step: [ranks[r] for r in sorted(ranks)] for step, ranks in sorted(last.items())}


def samples_per_step(ledger: Path) -> Dict[int, List[int]]:
    """{step: the global batch's samples, over all ranks, sorted}."""
    return {step: sorted(i for r in records for i in r["samples"])
            for step, records in surviving_history(ledger).items()}


def assert_exactly_once(ledger: Path, epochs: int = EPOCHS,
                        steps_per_epoch: int = STEPS_PER_EPOCH) -> None:
    """Every sample of every epoch exactly once in the surviving history, with every rank of
    each step present."""
    history = surviving_history(ledger)
    assert sorted(history) == list(range(1, steps_per_epoch * epochs + 1)), sorted(history)
    for step, records in history.items():
        assert [r["rank"] for r in records] == list(range(records[0]["world"])), step
    for epoch in range(epochs):
        seen = [i for s in range(epoch * steps_per_epoch + 1, (epoch + 1) * steps_per_epoch + 1)
                for r in history[s] for i in r["samples"]]
        assert len(seen) == len(set(seen)) == NUM_TRAIN, f"epoch {epoch}"


def first_step_after(ledger: Path, t: float) -> float:
    """When the first step after time `t` was recorded: restart-to-first-step."""
    return min(r["time"] for r in ledger_records(ledger) if r["time"] > t) - t


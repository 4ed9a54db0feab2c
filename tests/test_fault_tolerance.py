"""Fault tolerance under torchrun (gloo, 2 ranks, DDP): real processes killed, frozen, spun,
poisoned; the job must recover by itself and end exactly where an uninterrupted run ends.

Each scenario runs once, serially (2 cores), and is compared bit for bit with one
uninterrupted run (conftest's `ddp_reference`).
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import time
from pathlib import Path

import pytest
import torch

from checkpointing import commit
from checkpointing.storage import Store
from support.checkpoints import assert_matches_reference, checkpoint_contents, complete_now
from support.launch import (finish, free_port, kill_node, launch, port_open, process_state,
                            run_job, torchrun, wait_for, worker_pids)
from support.ledger import (RestartWatch, assert_exactly_once, assert_resumed,
                            first_step_after, ledger_records, steps_done)
from support.runs import FINAL, train_args


def report(name: str, seconds: float) -> None:
    """Restart-to-first-step times, for the record (`pytest -s` shows them)."""
    print(f"\nrestart-to-first-step ({name}): {seconds:.1f}s")


def restarted_group(run_root: Path, old_pids: set, world_size: int = 2) -> bool:
    now = worker_pids(run_root)
    return len(now) == world_size and old_pids.isdisjoint(now.values())


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_sigkill_of_rank_1_then_rank_0_at_random_steps(tiny_root, tmp_path, reference_runs,
                                                       strategy):
    """Kill rank 1, then (after the restart has made progress) rank 0, by PID, from
    outside: torchrun restarts the group both times and the run ends bit-identical, with
    replicated (DDP) and with sharded (FSDP) state."""
    ledger, ckpts = tmp_path / "ledger.jsonl", Store(str(tmp_path / "r" / "checkpoints"))
    rng = random.Random(f"{os.environ.get('PYTEST_SEED', '5')}-{strategy}")
    proc = launch(torchrun(2, max_restarts=3),
                  train_args(tiny_root, tmp_path, strategy=strategy))
    since = 0.0
    with RestartWatch(tmp_path) as watch:
        for victim in (1, 0):
            at = rng.randint(1, 3)
            wait_for(lambda: steps_done(ledger, since) >= at and commit.committed_steps(ckpts),
                     f"{at} steps", proc=proc)
            pids = worker_pids(tmp_path)
            os.kill(pids[victim], signal.SIGKILL)
            since = time.time()
            # A step the killed group's survivor records before torchrun stops it is not the
            # restart's: wait for a whole new group first, so the next kill hits that one.
            wait_for(lambda: restarted_group(tmp_path, set(pids.values())),
                     "a restarted group", proc=proc)
            restarted = time.time()
            wait_for(lambda: steps_done(ledger, restarted) >= 1,
                     "the restarted group's first step", proc=proc)
            report(f"SIGKILL rank {victim}, {strategy}", first_step_after(ledger, since))
        out = finish(proc)
    assert proc.returncode == 0, out[-4000:]
    assert len(watch.assert_every_restart_resumed(ledger)) == 2
    assert_matches_reference(tmp_path, reference_runs(strategy))


def test_a_dead_node_then_the_same_command_again(tiny_root, tmp_path, ddp_reference):
    """The whole node goes (the agent and its workers, SIGKILLed together) with no
    restarts left to torchrun: running the same command again resumes, to the same bits."""
    args, store = train_args(tiny_root, tmp_path), Store(str(tmp_path / "r" / "checkpoints"))
    agent = launch(torchrun(2), args)
    wait_for(lambda: commit.committed_steps(store), "a checkpoint", proc=agent)
    kill_node(agent)
    since, committed = time.time(), complete_now(store)
    run_job(torchrun(2), args)
    assert_resumed(tmp_path / "ledger.jsonl", since, committed)
    assert_matches_reference(tmp_path, ddp_reference)


def test_sigkill_inside_background_saves(tiny_root, tmp_path, ddp_reference):
    """Rank 0 dies while its 2nd checkpoint uploads from the staging tier, rank 1 while the
    restarted group loads a checkpoint, and rank 1 again right after writing its shard of
    a later save: no torn checkpoint may count as complete, and the run ends exactly."""
    fault = ("kill:rank=0:save=2:phase=uploading;kill:rank=1:at=load;"
             "kill:rank=1:save=3:phase=written")
    args = train_args(tiny_root, tmp_path, f"checkpoint.staging_dir={tmp_path / 'staging'}")
    store = Store(str(tmp_path / "r" / "checkpoints"))
    with RestartWatch(tmp_path) as watch:
        out = run_job(torchrun(2, max_restarts=3), args, fault=fault)
    assert out.count("fault injection") == 3
    # Three groups died; the one killed while loading stepped nothing, so the restart
    # after each of the first two is the third group's.
    assert len(watch.assert_every_restart_resumed(tmp_path / "ledger.jsonl")) == 3
    assert_matches_reference(tmp_path, ddp_reference)
    for step, _ in commit.find_complete(store):
        assert commit.verify(store, commit.step_dir_name(step), step) == 2  # both ranks


def test_crash_on_every_attempt_exhausts_the_restarts(tiny_root, tmp_path):
    """An exception at step 3 on every attempt: exactly max_restarts + 1 attempts, a
    non-zero exit, and no checkpoint past the last good step counted complete."""
    out = run_job(torchrun(2, max_restarts=2), train_args(tiny_root, tmp_path),
                  fault="raise:rank=1:step=3:every=1", expect=1)
    assert out.count("InjectedFault: injected exception at step 3") == 3
    store = Store(str(tmp_path / "r" / "checkpoints"))
    # Step 2's save may still have been in flight when the exception ended the group.
    complete = [s for s, _ in commit.find_complete(store)]
    assert set(complete) <= {2}
    for step in complete:
        assert commit.verify(store, commit.step_dir_name(step), step) == 2


def test_nan_and_replica_drift_roll_back_together(tiny_root, tmp_path):
    """A NaN loss on rank 1 at step 5 and a silent parameter drift on rank 0 after step 7:
    both ranks roll back to the last checkpoint each time, the NaN step's global batch is
    skipped and recorded, and the run finishes finite."""
    args = train_args(tiny_root, tmp_path, "health.replica_check_steps=2")
    launched = time.time()
    out = run_job(torchrun(2), args, fault="nan:rank=1:step=5;corrupt:rank=0:step=7")
    assert "non-finite loss at step 5: rolled back to step 4" in out
    assert "replica checksum mismatch at step 8 (ranks [1] differ from rank 0): rolled " \
           "back to step 6 (rollback 2" in out  # drift is not the batch's fault: no skip
    assert json.loads((tmp_path / "r" / "health.json").read_text())["skipped"] == [5]
    skipped = [r for r in ledger_records(tmp_path / "ledger.jsonl") if r.get("skipped")]
    assert sorted((r["step"], r["rank"]) for r in skipped) == [(5, 0), (5, 1)]
    assert_exactly_once(tmp_path / "ledger.jsonl")
    final = checkpoint_contents(tmp_path / "r" / "checkpoints" / FINAL)
    assert all(torch.isfinite(v).all() for k, v in final.items()
               if k.startswith("model.") and isinstance(v, torch.Tensor))
    assert json.loads(final["health.skipped"]) == [5]
    # Rank 0's books: the steps done in vain (5, 7 and 8, after the checkpoints at 4 and 6)
    # moved from compute to lost, at least an average step's worth; the parts cover at
    # least the span from the first step to the last (nothing left out) and at most the
    # time since the launch (nothing counted twice).
    books = json.loads((tmp_path / "r" / "goodput.json").read_text())
    seconds, steps = books["seconds"], books["counted_steps"]
    assert books["ended"] and books["reached"] == 12
    assert seconds["lost"] >= seconds["compute"] / steps, seconds
    times = [r["time"] for r in ledger_records(tmp_path / "ledger.jsonl")]
    assert max(times) - min(times) <= sum(seconds.values()) <= books["saved_at"] - launched


def test_nan_rolls_back_sharded_state_too(tiny_root, tmp_path):
    """The same rollback under FSDP: every rank reloads its shards of the checkpoint."""
    args = train_args(tiny_root, tmp_path, strategy="fsdp")
    out = run_job(torchrun(2), args, fault="nan:rank=0:step=7")
    assert "non-finite loss at step 7: rolled back to step 6; step 7's global batch is " \
           "skipped" in out
    assert_exactly_once(tmp_path / "ledger.jsonl")
    final = checkpoint_contents(tmp_path / "r" / "checkpoints" / FINAL)
    assert all(torch.isfinite(v).all() for k, v in final.items()
               if k.startswith(("model.", "optim.")) and isinstance(v, torch.Tensor))


def alive(pid: int) -> bool:
    """Running or stopped; not gone, and not a zombie waiting for its parent."""
    return process_state(pid) not in (None, "Z", "X")


def test_a_frozen_rank_is_caught_by_its_peers_timeout(tiny_root, tmp_path, ddp_reference):
    """A real SIGSTOP of rank 1: rank 0's collective times out after
    strategy.timeout_seconds, torchrun replaces the group, the run ends bit-identical."""
    ledger = tmp_path / "ledger.jsonl"
    args = train_args(tiny_root, tmp_path, "strategy.timeout_seconds=5")
    proc = launch(torchrun(2, max_restarts=1), args)
    with RestartWatch(tmp_path) as watch:
        # After a commit: a group frozen before its first one restarts from scratch.
        wait_for(lambda: steps_done(ledger) >= 3 and commit.committed_steps(watch.store),
                 "3 steps and a checkpoint", proc=proc)
        pids = worker_pids(tmp_path)
        frozen = pids[1]
        os.kill(frozen, signal.SIGSTOP)
        since = time.time()
        try:
            wait_for(lambda: not alive(pids[0]), "rank 0 to time out", timeout=120, proc=proc)
            # Caught: from here torchrun's SIGTERM to the stopped rank would only wait out
            # its fixed 30 s grace before the SIGKILL; let the rank take the SIGTERM.
            os.kill(frozen, signal.SIGCONT)
            wait_for(lambda: steps_done(ledger, since) >= 1, "the replaced group's first step",
                     timeout=180, proc=proc)
            report("SIGSTOP rank 1", first_step_after(ledger, since))
            out = finish(proc)
        finally:
            os.kill(frozen, signal.SIGCONT) if os.path.exists(f"/proc/{frozen}") else None
    assert proc.returncode == 0, out[-4000:]
    assert len(watch.assert_every_restart_resumed(ledger)) == 1
    assert re.search(r"[Tt]imed out|[Tt]imeout", out), out[-4000:]
    assert_matches_reference(tmp_path, ddp_reference)


def test_a_rank_spinning_in_its_own_code_is_ended_by_its_watchdog(tiny_root, tmp_path,
                                                                   ddp_reference):
    """Rank 1 spins forever (GIL held): a watchdog dumps the stacks after
    health.hang_seconds and exits; torchrun restarts the group. Rank 0, blocked in a
    collective waiting for rank 1, makes no progress either, and its watchdog may fire
    first (its dump then shows the collective it waits in); either ends the hang."""
    args = train_args(tiny_root, tmp_path, "health.hang_seconds=4")
    with RestartWatch(tmp_path) as watch:
        out = run_job(torchrun(2, max_restarts=1), args, fault="hang:rank=1:step=4")
    assert len(watch.assert_every_restart_resumed(tmp_path / "ledger.jsonl")) == 1
    # faulthandler's stack dump. Both ranks may dump at once, and faulthandler writes a
    # line in several pieces, so their lines can interleave: look for whole pieces only.
    dump = out[out.index("Timeout (0:00:04)!"):]
    assert "(most recent call first)" in dump and '  File "' in dump
    assert_matches_reference(tmp_path, ddp_reference)


def test_preflight_failure_exits_with_its_own_code(tiny_root, tmp_path):
    """torchrun reports the first worker it sees exit. The broken rank lingers 4 s at exit
    after its links close (a loaded machine's slow teardown), so the healthy rank, told by
    the closed links that it is gone, must still leave after it."""
    out = run_job(torchrun(2), train_args(tiny_root, tmp_path),
                  fault="preflight:rank=1:ms=4000", expect=1)
    assert "computed a wrong matrix product: replace this node" in out
    assert re.search(r"rank\s*:\s*1 \(local_rank: 1\)\s*\n\s*exitcode\s*:\s*3 ", out), out[-3000:]
    # nothing trained, nothing saved
    assert not list((tmp_path / "r" / "checkpoints").glob("step_*"))


def test_elastic_job_goes_on_without_a_dead_node(tiny_root, tmp_path):
    """`--nnodes 1:2`: two agents train at world size 2; the agent that does not host the
    rendezvous store dies with its workers (the whole "node"); the other re-forms the job
    at world size 1 and finishes, every sample of every epoch exactly once."""
    port, epochs = free_port(), 4  # 24 steps: time to kill a node while they run
    ledger = tmp_path / "ledger.jsonl"
    args = train_args(tiny_root, tmp_path, f"trainer.max_epochs={epochs}")
    # Both agents must form the first round together: in torch 2.14 a node that joins a
    # running job (scale-up) deadlocks the shared-store rendezvous (see README). The first
    # round closes as soon as both are in; only the round after the kill waits it out.
    agent = [torchrun(1, max_restarts=3, nnodes="1:2", rdzv_endpoint=f"127.0.0.1:{port}",
                      rdzv_conf="last_call_timeout=15,join_timeout=120"), args]
    host = launch(*agent)
    wait_for(lambda: port_open(port), "the first agent to host the rendezvous store",
             proc=host)
    other = launch(*agent)
    wait_for(lambda: any(r["world"] == 2 for r in ledger_records(ledger)[2:]),
             "steps at world size 2", proc=host)
    kill_node(other)
    since = time.time()
    wait_for(lambda: steps_done(ledger, since) >= 1, "a step after the node died", proc=host)
    report("a node of an elastic job died", first_step_after(ledger, since))
    out = finish(host)
    assert host.returncode == 0, out[-4000:]
    worlds = [r["world"] for r in ledger_records(ledger)]
    assert 2 in worlds and worlds[-1] == 1
    assert_exactly_once(ledger, epochs=epochs)


def test_an_elastic_job_grows_and_shrinks_with_fresh_store_addresses(tiny_root, tmp_path):
    """With TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (the README's workaround for torch 2.14's
    scale-up deadlock), each round's rank 0 hosts a fresh store: a second node joins a
    running job (1 -> 2 ranks), then dies (2 -> 1), and every sample of every epoch is
    still trained exactly once."""
    endpoint, epochs = f"127.0.0.1:{free_port()}", 30  # long enough to grow while it runs
    ledger = tmp_path / "ledger.jsonl"
    args = train_args(tiny_root, tmp_path, f"trainer.max_epochs={epochs}")
    agent = [torchrun(1, max_restarts=3, nnodes="1:2", rdzv_endpoint=endpoint,
                      rdzv_conf="last_call_timeout=1,join_timeout=60"), args]
    fresh = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    first = launch(*agent, **fresh)
    wait_for(lambda: len(ledger_records(ledger)) >= 3, "steps at world size 1", proc=first)
    second = launch(*agent, **fresh)
    wait_for(lambda: sum(r["world"] == 2 for r in ledger_records(ledger)) >= 6,
             "steps at world size 2", proc=first)
    kill_node(second)
    out = finish(first)
    assert first.returncode == 0, out[-4000:]
    worlds = [r["world"] for r in ledger_records(ledger)]
    assert worlds[0] == 1 and 2 in worlds and worlds[-1] == 1
    assert_exactly_once(ledger, epochs=epochs)

"""Launching: Hydra under torchrun (one run directory, Hydra's files from rank 0, a log file
per rank), node-local cache and staging directories, no sweeps under torchrun, and the run
lock, with real processes stopped and killed by PID."""

from __future__ import annotations

import os
import re
import signal
import time
from contextlib import suppress
from pathlib import Path

import pytest
from hydra.core.hydra_config import HydraConfig
from omegaconf import OmegaConf

from checkpointing import commit
from checkpointing.storage import Store
from support.checkpoints import (assert_matches_reference, assert_same_contents,
                                 checkpoint_contents, complete_now)
from support.launch import (PYTHON, finish, free_port, launch, run_job, torchrun, wait_for,
                            worker_pids)
from support.ledger import assert_resumed, ledger_records
from support.runs import FINAL, compose_config, train_args
from train.cluster.rank_dirs import LAUNCH_ID, RunPaths, mark_latest_record, run_paths
from train.tracking.tracker import mlflow_params


@pytest.mark.parametrize("rank, record, job", [("0", True, "train"),
                                               ("1", False, "train_rank1")])
def test_only_rank_0_writes_hydra_files_and_each_rank_names_its_log(monkeypatch, rank, record,
                                                                     job):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", rank)
    hydra = compose_config(["+experiment=resnet"], return_hydra_config=True).hydra
    assert hydra.output_subdir == (f".hydra/{LAUNCH_ID}" if record else None)
    assert hydra.job.name == job


def test_two_agents_on_one_machine_share_a_run_dir_as_two_nodes(tiny_root, tmp_path,
                                                                ddp_reference):
    """Two torchrun agents (one rank each) meet through a c10d rendezvous: one run
    directory (the default run name, composed on each rank), Hydra's files written once, a
    log file per rank, and a cache and a staging directory per node, the staging tier of
    either node left without partial checkpoints. It is the same 2-rank job as the
    standalone one, bit for bit."""
    staging, cache = tmp_path / "staging", tmp_path / "cache"
    args = [a for a in train_args(tiny_root, tmp_path, f"checkpoint.staging_dir={staging}",
                                  f"data.cache_dir={cache}", "data.cache=always")
            if a != "run.name=r"]
    prefix = torchrun(1, nnodes="2", rdzv_endpoint=f"127.0.0.1:{free_port()}")
    agents = [launch(prefix, args) for _ in range(2)]
    for agent in agents:
        out = finish(agent)
        assert agent.returncode == 0, out[-4000:]
    [run_dir] = [p for p in tmp_path.iterdir() if p.is_dir() and p not in (staging, cache)]
    [record] = [p for p in (run_dir / ".hydra").iterdir() if p.name != "latest"]
    assert (run_dir / ".hydra" / "latest").resolve() == record
    assert sorted(os.listdir(record)) == ["config.yaml", "hydra.yaml", "overrides.yaml"]
    assert sorted(p.name for p in run_dir.glob("*.log")) == ["train.log", "train_rank1.log"]
    for rank, log in enumerate(["train.log", "train_rank1.log"]):
        assert f"run {run_dir.name} in {run_dir} on cpu (rank {rank} of 2)" in (
            run_dir / log).read_text()
    assert sorted(os.listdir(cache)) == ["node_0", "node_1"]
    assert sorted(os.listdir(staging)) == ["node_0", "node_1"]
    # Rank 0's node drops its incomplete local copies (node 1 holds rank 1's files); node
    # 1 cleans its own, which nothing else ever did.
    assert os.listdir(staging / "node_0") == os.listdir(staging / "node_1") == []
    assert commit.committed_steps(Store(str(run_dir / "checkpoints")))[0] == 12
    contents = checkpoint_contents(run_dir / "checkpoints" / FINAL)
    assert contents.pop("run.run_name") == run_dir.name  # the reference is run r
    assert_same_contents(contents, {k: v for k, v in ddp_reference["contents"].items()
                                    if k != "run.run_name"})


def test_each_process_paths_are_one_value_and_the_config_stays_as_composed(tmp_path):
    """A replica group's and a node's own directories are decided once, as a value (they
    were written into the config, so `checkpoint.dir` meant the typed one before and the
    replica's after); MLflow records the paths the process uses."""
    cfg = compose_config(["+experiment=resnet", f"run.root={tmp_path}", "run.name=r",
                          f"checkpoint.dir={tmp_path}/ck/", f"data.cache_dir={tmp_path}/cache",
                          f"checkpoint.staging_dir={tmp_path}/stage"])
    composed = OmegaConf.to_yaml(cfg)
    paths = run_paths(cfg, replica_id=1, node_rank=2)
    assert paths == RunPaths(tmp_path / "r" / "replica_1", f"{tmp_path}/ck/replica_1",
                             f"{tmp_path}/stage/replica_1/node_2", f"{tmp_path}/cache/node_2")
    assert run_paths(cfg, 1, node_rank=None).cache_dir == f"{tmp_path}/cache"
    params = mlflow_params(paths.applied_to(cfg))
    assert [params[k] for k in ("checkpoint.dir", "checkpoint.staging_dir", "data.cache_dir")
            ] == [paths.checkpoint_dir, paths.staging_dir, paths.cache_dir]
    assert OmegaConf.to_yaml(cfg) == composed


def test_a_sweep_under_torchrun_is_refused(tiny_root, tmp_path):
    out = run_job(torchrun(2), ["-m", "train", "-m", *train_args(tiny_root, tmp_path)[2:],
                                "optim.lr=0.1,0.2"], expect=1)
    # The first rank to refuse exits 2, and torchrun may end the other before it prints.
    assert out.count("error: a multirun sweep (-m, or hydra.mode=MULTIRUN) cannot run under "
                     "torchrun (WORLD_SIZE=2)") >= 1
    assert re.search(r"exitcode\s*:\s*2 ", out), out[-3000:]
    assert "one torchrun per job" in out and "(rank 0 of 2)" not in out


def files_under(root):
    return {p: p.read_bytes() for p in root.rglob("*") if p.is_file()}


def test_a_second_trainer_is_refused_and_a_dead_ones_lock_taken_over(tiny_root, tmp_path):
    """The refused launch leaves every file of the live run as it was (its log only grows),
    keeps its own Hydra record, and `.hydra/latest` stays at the live run's record."""
    args = train_args(tiny_root, tmp_path)
    ledger, run_dir = tmp_path / "ledger.jsonl", tmp_path / "r"
    latest = run_dir / ".hydra" / "latest"
    first = launch(PYTHON, args)
    try:
        wait_for(lambda: ledger_records(ledger), "the first step", proc=first)
        # Frozen, it holds the lock without finishing its few steps (or taking a core).
        os.killpg(first.pid, signal.SIGSTOP)
        steps = len(ledger_records(ledger))
        first_record = latest.resolve()
        assert first_record.name.endswith(f"-{first.pid}")
        before = files_under(run_dir)
        out = run_job(PYTHON, args + ["optim.lr=0.5"], expect=2)
        assert "error: run r is in use by another trainer" in out
        assert f"pid {first.pid} on" in out and len(ledger_records(ledger)) == steps
        after = files_under(run_dir)
        for path, content in before.items():
            if path.name == "train.log":  # Hydra's log handler appends
                assert after[path].startswith(content)
            else:
                assert after[path] == content, path
        assert latest.resolve() == first_record
        [refused] = {p.parent for p in after.keys() - before.keys()}
        assert refused.parent == run_dir / ".hydra"
        assert "optim.lr=0.5" in (refused / "overrides.yaml").read_text()
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        finish(first)
    out = run_job(PYTHON, args)
    assert f"taking over from pid {first.pid} on" in out
    assert (run_dir / "run.lock").read_text() == ""  # released on the way out
    assert latest.resolve() not in (first_record, refused)
    assert len(os.listdir(run_dir / ".hydra")) == 4  # three launches' records and latest


def test_killing_only_the_agent_leaves_orphans_that_keep_the_run_locked(tiny_root, tmp_path,
                                                                        ddp_reference):
    """The agent dies, its workers (each in a session of its own) live on: a relaunch is
    refused while they live, and once they are gone it resumes to the same final bits as a
    run that was never interrupted."""
    args = train_args(tiny_root, tmp_path)
    ckpts = Store(str(tmp_path / "r" / "checkpoints"))
    # Output to a file: the orphans keep a pipe's write end open, so a pipe never ends.
    agent = launch(torchrun(2), args, log=tmp_path / "agent.log")
    wait_for(lambda: commit.committed_steps(ckpts), "a checkpoint", proc=agent)
    workers = worker_pids(tmp_path)
    try:
        assert sorted(workers) == [0, 1]
        for pid in workers.values():  # frozen, so that they cannot finish the tiny run first
            os.kill(pid, signal.SIGSTOP)
        os.kill(agent.pid, signal.SIGKILL)
        finish(agent)
        assert worker_pids(tmp_path) == workers  # orphans now

        out = run_job(torchrun(2), args, expect=1)
        assert out.count("error: run r is in use by another trainer") == 2  # on both ranks
        assert f"pid {workers[0]} on" in out and f":{workers[1]}" in out
    finally:
        for pid in workers.values():
            with suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    wait_for(lambda: not worker_pids(tmp_path), "the orphans to be gone")
    since, committed = time.time(), complete_now(ckpts)
    out = run_job(torchrun(2), args)
    assert f"taking over from pid {workers[0]} on" in out
    assert_resumed(tmp_path / "ledger.jsonl", since, committed)
    assert_matches_reference(tmp_path, ddp_reference)


def test_the_latest_link_moves_to_this_launchs_record_or_warns(tmp_path, monkeypatch, caplog):
    cfg = compose_config(["+experiment=resnet"], return_hydra_config=True)
    cfg.hydra.runtime.output_dir = str(tmp_path)
    monkeypatch.setattr(HydraConfig, "get", staticmethod(lambda: cfg.hydra))
    hydra_dir = tmp_path / ".hydra"
    (hydra_dir / LAUNCH_ID).mkdir(parents=True)
    (hydra_dir / "older").mkdir()
    (hydra_dir / "latest").symlink_to("older")
    mark_latest_record()
    assert (hydra_dir / "latest").resolve() == hydra_dir / LAUNCH_ID
    assert sorted(os.listdir(hydra_dir)) == sorted([LAUNCH_ID, "latest", "older"])

    def no_symlinks(*args):
        raise PermissionError("symlinks not supported")
    monkeypatch.setattr(Path, "symlink_to", no_symlinks)
    (hydra_dir / "latest").unlink()
    mark_latest_record()  # the run goes on without the link
    assert "could not link" in caplog.text and "symlinks not supported" in caplog.text

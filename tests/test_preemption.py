"""Preemption: SIGTERM (a scheduler, a spot machine), SIGINT (Ctrl-C) and the time-limit
warnings (SIGUSR1/SIGUSR2: SLURM's --signal, submitit) stop the run at a committed
checkpoint with exit code 75, and the same command then redoes no step.

Real signals to real processes: a single `python -m train`, its whole process group as a
terminal's Ctrl-C reaches it (data-loader workers included), and a torchrun job, signalled
through its agent (as a scheduler does) or at one rank only; and the handlers' rules for
repeats, start-up and the end of a run in small processes of their own.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from checkpointing import commit
from checkpointing.storage import Store
from support.checkpoints import assert_matches_reference, complete_now
from support.launch import (PYTHON, descendants, finish, launch, run, run_job, torchrun,
                            wait_for, worker_pids)
from support.ledger import (RestartWatch, assert_exactly_once, assert_resumed, ledger_records,
                            recorded_steps)
from support.runs import REPO, compose_config, train_args

EXIT_PREEMPTED = 75
# A long interval: without the preemption save, a stopped run would have no checkpoint.
NO_PERIODIC_SAVES = "checkpoint.interval_steps=1000"


def committed(run_root: Path) -> list:
    return commit.committed_steps(Store(str(run_root / "r" / "checkpoints")))


def rerun_resumes_at(run_root: Path, prefix: list, args: list, stopped: int) -> None:
    """The same command again resumes from the step the run stopped at, on every rank."""
    since = time.time()
    committed_then = complete_now(Store(str(run_root / "r" / "checkpoints")))
    run_job(prefix, args)
    assert assert_resumed(run_root / "ledger.jsonl", since, committed_then) == stopped


def assert_stopped_at_a_commit(out: str, run_root: Path) -> int:
    """The run said, in one line, where it stopped; that checkpoint is complete and is the
    last step the loop did. Returns that step."""
    # No traceback from our code (torchrun's agent prints its own for the signal it got).
    assert "KeyboardInterrupt" not in out, out[-3000:]
    assert not any(f'File "{REPO / package}' in out for package in ("train", "data",
                                                                     "checkpointing")), out
    lines = [line for line in out.splitlines() if "preempted by SIG" in line]
    assert len(lines) >= 1, out[-3000:]
    step = int(lines[0].split(" at step ")[1].split(":")[0])
    assert step in committed(run_root), (step, committed(run_root))
    commit.verify(Store(str(run_root / "r" / "checkpoints")), commit.step_dir_name(step), step)
    last_done = max(r["step"] for r in ledger_records(run_root / "ledger.jsonl"))
    assert last_done == step, (last_done, step)
    return step


@pytest.mark.parametrize("signum, workers, reach", [
    (signal.SIGTERM, 0, "process"),  # a scheduler signals the process
    (signal.SIGINT, 2, "group"),  # Ctrl-C reaches the terminal's process group, workers too
    # SLURM's --signal=USR2@T before a time limit reaches every process of the step (its
    # cgroup), the loader's worker too
    (signal.SIGUSR2, 1, "tree"),
])
def test_signal_saves_then_the_rerun_redoes_nothing(tiny_root, tmp_path, signum, workers,
                                                    reach):
    ledger = tmp_path / "ledger.jsonl"
    args = train_args(tiny_root, tmp_path, NO_PERIODIC_SAVES, f"data.num_workers={workers}",
                      strategy="single")
    proc = launch(PYTHON, args)
    wait_for(lambda: len(ledger_records(ledger)) >= 2, "two steps", proc=proc)
    if reach == "group":
        os.killpg(proc.pid, signum)
    else:
        for pid in [proc.pid, *descendants(proc.pid)] if reach == "tree" else [proc.pid]:
            os.kill(pid, signum)
    out = finish(proc)
    assert proc.returncode == EXIT_PREEMPTED, f"exit {proc.returncode}:\n{out[-3000:]}"
    stopped = assert_stopped_at_a_commit(out, tmp_path)

    rerun_resumes_at(tmp_path, PYTHON, args, stopped)
    assert_exactly_once(ledger)
    redone = [key for key, n in recorded_steps(ledger).items() if n > 1]
    assert redone == [], f"stopped at {stopped}, then redid {redone}"


def test_torchrun_agent_signalled_all_ranks_stop_at_one_step(tiny_root, tmp_path,
                                                             ddp_reference):
    """A scheduler signals torchrun; its agent passes SIGTERM to every rank, which may be at
    different points of a step: they agree on one step, save it, and the rerun ends with
    the bits of a run that was never stopped."""
    ledger = tmp_path / "ledger.jsonl"
    # With a loader worker per rank: torchrun signals each rank's whole process group.
    args = train_args(tiny_root, tmp_path, NO_PERIODIC_SAVES, "data.num_workers=1")
    proc = launch(torchrun(2), args)
    wait_for(lambda: len(ledger_records(ledger)) >= 4, "two steps on two ranks", proc=proc)
    proc.send_signal(signal.SIGTERM)
    out = finish(proc)
    assert proc.returncode != 0, out[-3000:]
    assert f"exitcode: {EXIT_PREEMPTED}" in out or "preempted by SIGTERM" in out, out[-3000:]
    stopped = assert_stopped_at_a_commit(out, tmp_path)
    assert {r["rank"] for r in ledger_records(ledger) if r["step"] == stopped} == {0, 1}

    rerun_resumes_at(tmp_path, torchrun(2), args, stopped)
    assert_matches_reference(tmp_path, ddp_reference)
    assert [k for k, n in recorded_steps(ledger).items() if n > 1] == []


def test_a_signal_to_one_rank_stops_the_group_at_a_checkpoint(tiny_root, tmp_path):
    """Only rank 1 is signalled: rank 0 learns it from a per-step all-reduce (here the one
    that runs with the health checks off), both save the same step, and torchrun's restart
    resumes from it with nothing redone."""
    ledger = tmp_path / "ledger.jsonl"
    proc = launch(torchrun(2, max_restarts=1), train_args(tiny_root, tmp_path,
                                                          NO_PERIODIC_SAVES,
                                                          "health.enabled=false"))
    with RestartWatch(tmp_path) as watch:
        wait_for(lambda: len(ledger_records(ledger)) >= 4, "two steps on two ranks", proc=proc)
        pids = worker_pids(tmp_path)
        os.kill(pids[1], signal.SIGTERM)
        out = finish(proc)
    assert proc.returncode == 0, out[-8000:]
    assert "preempted by a signal to another rank" in out, out[-8000:]
    assert len(watch.assert_every_restart_resumed(ledger)) == 1
    assert_exactly_once(ledger)
    assert [k for k, n in recorded_steps(ledger).items() if n > 1] == []


def test_a_second_signal_exits_at_once():
    """The first signal only asks; the second ends the process by that signal."""
    code = ("import os, signal, time\n"
            "from train.cluster.preemption import catch_preemption\n"
            "with catch_preemption() as flag:\n"
            "    os.kill(os.getpid(), signal.SIGINT)\n"
            "    time.sleep(0.5)\n"
            "    assert flag.requested()\n"
            "    print('asked', flush=True)\n"
            "    os.kill(os.getpid(), signal.SIGINT)\n"
            "    time.sleep(30)\n"
            "    print('still running')\n")
    proc = run(PYTHON, ["-c", code], timeout=60)
    assert proc.stdout.split() == ["asked"], proc.stdout + proc.stderr
    assert proc.returncode == -signal.SIGINT, proc.returncode
    assert "second SIGINT: exiting now" in proc.stderr


def test_an_agent_killed_by_a_signal_it_does_not_handle_stops_its_ranks_at_a_checkpoint(
        tiny_root, tmp_path):
    """torchrun's agent handles SIGTERM, SIGINT, SIGHUP and SIGQUIT only: a time-limit
    SIGUSR2 sent to it alone kills it. Its ranks, told by the kernel (parent-death signal),
    stop at one committed step instead of training on unsupervised."""
    ledger, log = tmp_path / "ledger.jsonl", tmp_path / "agent.log"
    # Output to a file: the orphaned ranks keep a pipe's write end open
    agent = launch(torchrun(2), train_args(tiny_root, tmp_path, NO_PERIODIC_SAVES), log=log)
    wait_for(lambda: len(ledger_records(ledger)) >= 4, "two steps on two ranks", proc=agent)
    agent.send_signal(signal.SIGUSR2)
    assert agent.wait(timeout=60) == -signal.SIGUSR2
    wait_for(lambda: not worker_pids(tmp_path), "the ranks to stop")
    out = log.read_text()
    assert out.count("preempted by SIGTERM at step") == 2, out[-3000:]
    stopped = assert_stopped_at_a_commit(out, tmp_path)
    assert {r["rank"] for r in ledger_records(ledger) if r["step"] == stopped} == {0, 1}


def test_a_stop_signal_during_start_up_is_one_line_and_exit_75(tiny_root, tmp_path):
    """Before training nothing is saved: the process leaves at once, asking for a requeue."""
    args = train_args(tiny_root, tmp_path, strategy="single")
    proc = launch(PYTHON, args, stderr_apart=True)
    # Hydra writes its record, then imports torch: seconds, with our start-up handler
    wait_for(lambda: (tmp_path / "r" / ".hydra").exists(), "Hydra's record", proc=proc)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == EXIT_PREEMPTED, (proc.returncode, err[-3000:])
    assert err.splitlines() == ["SIGTERM received before training started: nothing to save; "
                                "run the same command again (exit code 75: requeue)"], err
    assert not (tmp_path / "ledger.jsonl").exists()


def signalled(code: str) -> subprocess.CompletedProcess:
    """`code` run after `from train.cluster.preemption import *` in a process of its own."""
    return run(PYTHON, ["-c", "import os, signal, time\nfrom train.cluster.preemption import *\n"
                        + code], timeout=60)


def test_a_repeated_or_second_scheduler_signal_does_not_cancel_the_save():
    """SLURM signals every process of a step and torchrun's agent forwards the signal again;
    a time limit's SIGTERM follows its SIGUSR2 warning: none of them may end the save."""
    proc = signalled("with catch_preemption() as flag:\n"
                     "    for sig in (signal.SIGUSR2, signal.SIGUSR2, signal.SIGTERM):\n"
                     "        os.kill(os.getpid(), sig)\n"
                     "        time.sleep(0.2)\n"
                     "    print(flag.signal_name, flush=True)\n")
    assert (proc.returncode, proc.stdout.split()) == (0, ["SIGUSR2"]), proc.stderr
    assert proc.stderr.count("received while stopping") == 2, proc.stderr


def test_a_signal_after_the_run_ended_leaves_its_exit_status():
    proc = signalled("with catch_preemption():\n"
                     "    pass\n"
                     "os.kill(os.getpid(), signal.SIGTERM)\n"
                     "time.sleep(0.2)\n"
                     "with catch_preemption() as flag:  # a multirun's next job\n"
                     "    print(flag.signal_name, flush=True)\n")
    assert (proc.returncode, proc.stdout.split()) == (0, ["SIGTERM"]), proc.stderr
    assert "SIGTERM received after training ended" in proc.stderr


def test_a_signal_left_out_of_stop_signals_keeps_its_default_action():
    proc = signalled("with catch_preemption(['SIGTERM']):\n"
                     "    os.kill(os.getpid(), signal.SIGUSR1)\n"
                     "    time.sleep(30)\n")
    assert proc.returncode == -signal.SIGUSR1, (proc.returncode, proc.stderr)


@pytest.mark.parametrize("value", ["[SIGKILL]", "[sigterm]", "SIGTERM", "[9]"])
def test_stop_signals_takes_only_the_names_it_can_catch(value):
    chosen = compose_config(["trainer.stop_signals=[SIGTERM,SIGUSR2]"]).trainer.stop_signals
    assert [s.value for s in chosen] == ["SIGTERM", "SIGUSR2"]
    with pytest.raises(Exception, match="stop_signals"):
        compose_config([f"trainer.stop_signals={value}"])


def test_a_launchers_own_handler_runs_once_the_checkpoint_is_committed():
    """submitit handles SIGUSR2 itself (it requeues the job, then exits): the trainer saves
    first, then hands the signal on."""
    proc = signalled("def requeue(signum, frame):\n"
                     "    print('requeued on', signal.Signals(signum).name, flush=True)\n"
                     "    raise SystemExit(255)\n"
                     "signal.signal(signal.SIGUSR2, requeue)\n"
                     "try:\n"
                     "    with catch_preemption() as flag:\n"
                     "        os.kill(os.getpid(), signal.SIGUSR2)\n"
                     "        time.sleep(0.2)\n"
                     "        print('committed', flush=True)\n"
                     "        raise Preempted(flag.signal_name, 3, saved=True)\n"
                     "except Preempted as stopped:\n"
                     "    stopped.hand_on()\n")
    assert proc.returncode == 255, proc.stderr
    assert proc.stdout.splitlines() == ["committed", "requeued on SIGUSR2"], proc.stdout


def test_a_signal_the_process_was_started_ignoring_stays_ignored():
    """`nohup python -m train ...` must survive the terminal's hang-up, as it always did."""
    proc = signalled("signal.signal(signal.SIGHUP, signal.SIG_IGN)  # what nohup does\n"
                     "catch_start_up(os.getppid())\n"
                     "with catch_preemption() as flag:\n"
                     "    os.kill(os.getpid(), signal.SIGHUP)\n"
                     "    time.sleep(0.2)\n"
                     "    print(flag.requested(), flush=True)\n")
    assert (proc.returncode, proc.stdout.split()) == (0, ["False"]), proc.stderr


@pytest.mark.parametrize("signum, reach", [(signal.SIGUSR2, "tree"), (signal.SIGTERM, "group")])
def test_a_signal_to_every_process_spares_the_checkpoint_process(tiny_root, tmp_path, signum,
                                                                 reach):
    """SLURM's --signal=USR2@T reaches every process of the step, torchrun's agent signals
    its worker's whole process group: DCP's checkpoint process too (`async_mode=process`,
    alive since the first save). It must not die of a signal that asks the trainer to save
    (it did: the save in flight failed, and the stop's own save with it: exit 2, nothing
    saved)."""
    ledger = tmp_path / "ledger.jsonl"
    args = train_args(tiny_root, tmp_path, "checkpoint.async_mode=process",
                      "checkpoint.interval_steps=1", strategy="single")
    proc = launch(PYTHON, args)
    wait_for(lambda: len(ledger_records(ledger)) >= 2 and committed(tmp_path),
             "two steps and a save by the checkpoint process", proc=proc)
    if reach == "group":
        os.killpg(proc.pid, signum)
    else:
        for pid in [proc.pid, *descendants(proc.pid)]:
            os.kill(pid, signum)
    out = finish(proc)
    assert proc.returncode == EXIT_PREEMPTED, f"exit {proc.returncode}:\n{out[-3000:]}"
    assert_stopped_at_a_commit(out, tmp_path)
    assert not re.search(r"checkpoint at step \d+ failed|resource_tracker", out), out[-3000:]

"""Starting the trainer (or torchrun, or any module of this checkout) in a subprocess, and
finding, waiting for and killing the processes it starts."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

from support.runs import REPO

PYTHON = [sys.executable]


def train_env(**extra: str) -> Dict[str, str]:
    """The environment a test's trainer runs in: this checkout on the path, one thread per
    process (ranks share 2 cores), no MLflow or fault settings leaking in from outside."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("MLFLOW_") and k != "GOODPUT_FAULT"}
    env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", **extra)
    return env


def torchrun(nproc: int, *, max_restarts: int = 0, nnodes: str = "1",
             rdzv_endpoint: Optional[str] = None, rdzv_id: str = "test",
             rdzv_conf: Optional[str] = None) -> List[str]:
    """The `torchrun` launcher as a command prefix: `--standalone` unless a c10d endpoint is
    given (then `nnodes` may be a range, as for an elastic job). Append `-m train ...` or a
    script."""
    args = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
            f"--max-restarts={max_restarts}", "--monitor-interval=0.2"]
    if rdzv_endpoint is None:
        return args + ["--standalone"]
    args += [f"--nnodes={nnodes}", "--rdzv-backend=c10d", f"--rdzv-endpoint={rdzv_endpoint}",
             f"--rdzv-id={rdzv_id}"]
    return args + ([f"--rdzv-conf={rdzv_conf}"] if rdzv_conf else [])


def launch(prefix: Sequence[str], args: Sequence[str], fault: str = "",
           log: Optional[Path] = None, cwd: Path = REPO, stderr_apart: bool = False,
           **env: str) -> subprocess.Popen:
    """Start `prefix + args` (python or torchrun, then `-m train ...`) in a session of its
    own, as a job scheduler would: a signal to its process group reaches it and its
    data-loader workers, and `kill_node` kills an agent with its workers. Output goes to
    `log` (appended) or a pipe, stderr merged into stdout unless `stderr_apart`. `fault`:
    GOODPUT_FAULT; `env`: more environment variables."""
    env = train_env(**({"GOODPUT_FAULT": fault} if fault else {}), **env)
    out = open(log, "a") if log else subprocess.PIPE
    return subprocess.Popen([*prefix, *args], cwd=cwd, env=env, stdout=out,
                            stderr=subprocess.PIPE if stderr_apart else subprocess.STDOUT,
                            text=True, start_new_session=True)


def _communicate(proc: subprocess.Popen, timeout: float) -> tuple:
    """(stdout, stderr) once `proc` ends; past `timeout` its whole session is killed and the
    test fails with the end of its output."""
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"timed out after {timeout}s:\n{(out or '')[-4000:]}"
                             f"{(err or '')[-4000:]}")
    return out or "", err or ""


def finish(proc: subprocess.Popen, timeout: float = 300) -> str:
    """Its output, once it ends."""
    return _communicate(proc, timeout)[0]


def run_job(prefix: Sequence[str], args: Sequence[str], fault: str = "", expect: int = 0,
            timeout: float = 300, **env: str) -> str:
    """Launch, wait, check the exit code; the output."""
    proc = launch(prefix, args, fault, **env)
    out = finish(proc, timeout)
    assert proc.returncode == expect, f"exit {proc.returncode}, expected {expect}:\n" + out[-5000:]
    return out


def run(prefix: Sequence[str], args: Sequence[str], cwd: Path = REPO,
        timeout: float = 300) -> subprocess.CompletedProcess:
    """Launch and wait, stdout and stderr apart (for tests of what each one says)."""
    proc = launch(prefix, args, cwd=cwd, stderr_apart=True)
    out, err = _communicate(proc, timeout)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def run_train(args: Sequence[str], cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    """`python -m train ARGS` in `cwd`, as a user would type it."""
    return run(PYTHON, ["-m", "train", *args], cwd=cwd, timeout=timeout)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_open(port: int) -> bool:
    """Whether something listens on 127.0.0.1:`port`."""
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def wait_for(condition: Callable[[], object], what: str, timeout: float = 120,
             proc: Optional[subprocess.Popen] = None) -> None:
    """Poll `condition` until it holds; fail after `timeout`, or at once if `proc` ends."""
    deadline = time.monotonic() + timeout
    while not condition():
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the job ended (exit {proc.returncode}) before {what}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def process_state(pid: int) -> Optional[str]:
    """The state letter of process `pid` in /proc (R, S, T stopped, Z zombie, ...); None
    when it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def trainers(run_root: Path, also: bytes = b"") -> Dict[int, Dict[bytes, bytes]]:
    """{pid: environment} of the live trainer processes of the run under `run_root` (their
    command line holding `also` too), found by their command line: torchrun's agents and the
    trainers' data-loader workers (forked children with the same command line) left out."""
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
        if (f"run.root={run_root}".encode() in cmdline and also in cmdline
                and b"torch.distributed.run" not in cmdline and stat[0] != "Z"):
            candidates[int(entry.name)] = (environ, int(stat[1]))
    return {pid: environ for pid, (environ, parent) in candidates.items()
            if parent not in candidates}


def worker_pids(run_root: Path) -> Dict[int, int]:
    """{rank: pid} of the live trainer processes of the run under `run_root`, by the RANK
    torchrun gave them."""
    return {int(environ[b"RANK"]): pid for pid, environ in trainers(run_root).items()
            if b"RANK" in environ}


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

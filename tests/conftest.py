"""Shared fixtures: a tiny shapes dataset, Hydra's compose API, and a `python -m train` runner."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, List, Optional

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from data import synthetic
from train.config import register_configs

REPO = Path(__file__).resolve().parents[1]
CONF = REPO / "conf"

# Small enough that a whole run takes seconds: 120 + 30 images of 32x24.
TINY = {"num_train": 120, "num_val": 30, "size": 32}


@pytest.fixture(scope="session")
def tiny_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("data") / "shapes"
    synthetic.generate(root, TINY["num_train"], TINY["num_val"], TINY["size"], seed=0, workers=2)
    return root


def tiny_overrides(root: Path) -> List[str]:
    """A few-second run on the tiny dataset."""
    return [f"data.root={root}", "data.image_size=32", "data.global_batch_size=20",
            "data.val_batch_size=30", "trainer.max_epochs=2", "scheduler.warmup_steps=2",
            "trainer.log_every_steps=2", "data.num_workers=0"]


def compose_config(overrides: List[str], return_hydra_config: bool = False) -> DictConfig:
    register_configs()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name="config", overrides=overrides,
                       return_hydra_config=return_hydra_config)


def run_train(args: List[str], cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    """`python -m train ARGS` in `cwd`, as a user would type it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-m", "train", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def rclone_mount(served: Path, mountpoint: Path, cache_mode: str = "off",
                 server_log: Optional[Path] = None) -> Iterator[Path]:
    """A real network volume on loopback: `rclone serve webdav` of `served`, FUSE-mounted
    at `mountpoint` with `rclone mount` (`cache_mode`: rclone's --vfs-cache-mode)."""
    if not shutil.which("rclone") or not os.path.exists("/dev/fuse"):
        pytest.fail("rclone and FUSE are required: apt-get install rclone fuse3 (.ci/run does)")
    port = free_port()
    log_args = ["-vv", "--log-file", str(server_log)] if server_log else []
    server = subprocess.Popen(["rclone", "serve", "webdav", str(served),
                               "--addr", f"127.0.0.1:{port}", *log_args],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    mountpoint.mkdir(parents=True, exist_ok=True)
    try:
        deadline = time.monotonic() + 30
        while True:  # the server is up once its port answers
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        subprocess.run(["rclone", "mount", ":webdav:", str(mountpoint),
                        "--webdav-url", f"http://127.0.0.1:{port}",
                        "--vfs-cache-mode", cache_mode, "--dir-cache-time", "0s",
                        "--cache-dir", str(mountpoint.parent / f".{mountpoint.name}-vfs"),
                        "--daemon"], check=True, timeout=60)
        while not os.path.ismount(mountpoint):
            if time.monotonic() > deadline:
                raise TimeoutError(f"rclone mount at {mountpoint} did not come up")
            time.sleep(0.1)
        yield mountpoint
    finally:
        subprocess.run(["fusermount", "-uz", str(mountpoint)], capture_output=True)
        server.terminate()
        server.wait(timeout=30)


def torchrun(nproc: int, *, max_restarts: int = 0, nnodes: str = "1",
             rdzv_endpoint: Optional[str] = None, rdzv_id: str = "test",
             rdzv_conf: Optional[str] = None) -> List[str]:
    """The `torchrun` launcher as a command prefix: `--standalone` unless a c10d endpoint is
    given (then `nnodes` may be a range, as for an elastic job). Append `-m train ...`."""
    args = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
            f"--max-restarts={max_restarts}", "--monitor-interval=0.2"]
    if rdzv_endpoint is None:
        return args + ["--standalone"]
    args += [f"--nnodes={nnodes}", "--rdzv-backend=c10d", f"--rdzv-endpoint={rdzv_endpoint}",
             f"--rdzv-id={rdzv_id}"]
    return args + ([f"--rdzv-conf={rdzv_conf}"] if rdzv_conf else [])


def train_env(**extra: str) -> dict:
    """The environment a test's trainer runs in: this checkout on the path, one thread per
    process (ranks share 2 cores), no MLflow or fault settings leaking in from outside."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("MLFLOW_") and k != "GOODPUT_FAULT"}
    env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", **extra)
    return env


@pytest.fixture(scope="session")
def reference_runs(tiny_root: Path, tmp_path_factory: pytest.TempPathFactory):
    """`reference_runs(strategy)`: the uninterrupted 2-rank run (tests/faultlib.py's
    `train_args`) that faulty runs are compared with, made once per strategy on first use:
    its final checkpoint, flattened, and the samples of each step."""
    from faultlib import FINAL, run_job, samples_per_step, train_args
    from test_resume import checkpoint_contents
    made: dict = {}

    def reference(strategy: str = "ddp") -> dict:
        if strategy not in made:
            root = tmp_path_factory.mktemp(f"reference_{strategy}")
            run_job(torchrun(2), train_args(tiny_root, root, strategy=strategy))
            made[strategy] = {
                "contents": checkpoint_contents(root / "r" / "checkpoints" / FINAL),
                "samples": samples_per_step(root / "ledger.jsonl")}
        return made[strategy]
    return reference


@pytest.fixture(scope="session")
def ddp_reference(reference_runs) -> dict:
    return reference_runs("ddp")

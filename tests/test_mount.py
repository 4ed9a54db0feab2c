"""Training from real remote volumes: a FUSE mount of a WebDAV server (rclone), and an fsspec
http:// URL served by a local HTTP server. The servers' own request logs are the evidence."""

from __future__ import annotations

import re
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Iterator, List

import pytest

from data.ledger import read_ledger
from support.launch import free_port, port_open, run_train, wait_for
from support.mount import rclone_mount
from support.runs import tiny_overrides


@pytest.fixture
def webdav_mount(tiny_root: Path, tmp_path: Path) -> Iterator[tuple]:
    """(mount point, server log): the tiny dataset served over WebDAV and FUSE-mounted,
    with rclone's own caching off so every read of the mount reaches the server."""
    log = tmp_path / "server.log"
    with rclone_mount(tiny_root, tmp_path / "mnt", server_log=log) as mnt:
        yield mnt, log


def gets(log: Path, pattern: str) -> Counter:
    """How often each file was sent, from a server log, by a regex with one group (path)."""
    return Counter(re.findall(pattern, log.read_text()))


def jpegs(root: Path) -> List[str]:
    return sorted(f"/{p.relative_to(root)}" for p in root.rglob("*.jpg"))


def train_from(root: str, tmp_path: Path, *extra: str, logger: str = "logger=none") -> None:
    result = run_train(["+experiment=resnet", *tiny_overrides(root), logger,
                        "data.num_workers=2", "checkpoint.enabled=false",
                        f"run.root={tmp_path / 'runs'}", *extra], cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]


WEBDAV_GET = r"INFO  : (/\S+\.jpg): GET from"


@pytest.mark.mount
def test_training_from_a_fuse_mount_reads_each_file_from_the_server_once(
        webdav_mount, tiny_root, tmp_path):
    mnt, log = webdav_mount
    train_from(str(mnt), tmp_path, f"data.cache_dir={tmp_path / 'cache'}")  # two epochs
    assert gets(log, WEBDAV_GET) == Counter({f: 1 for f in jpegs(tiny_root)})

    # The control: without our cache every epoch (and every evaluation) reads again; the
    # loader's workers also read ahead into an epoch that is never trained, so "at least".
    log.write_text("")
    train_from(str(mnt), tmp_path, "data.cache_dir=null", "run.name=nocache")
    reads = gets(log, WEBDAV_GET)
    assert sorted(reads) == jpegs(tiny_root) and min(reads.values()) >= 2, reads


@pytest.fixture
def http_server(tiny_root: Path, tmp_path: Path) -> Iterator[tuple]:
    port, log = free_port(), tmp_path / "http.log"
    with open(log, "w") as err:
        server = subprocess.Popen([sys.executable, "-m", "http.server", str(port), "--bind",
                                   "127.0.0.1", "--directory", str(tiny_root)],
                                  stdout=subprocess.DEVNULL, stderr=err)
    try:
        wait_for(lambda: port_open(port), "http.server", timeout=30, proc=server)
        yield f"http://127.0.0.1:{port}", log
    finally:
        server.terminate()
        server.wait(timeout=30)


def test_training_from_an_http_url_through_fsspec(http_server, tiny_root, tmp_path):
    """Two epochs from http://; also what the run reports: the data metrics in MLflow, and
    the audit ledger, which must show every sample exactly once per epoch."""
    url, log = http_server
    db, ledger = tmp_path / "mlflow.db", tmp_path / "ledger.jsonl"
    train_from(url, tmp_path, f"data.cache_dir={tmp_path / 'cache'}", f"audit.ledger={ledger}",
               logger=f"logger.tracking_uri=sqlite:///{db}")
    assert gets(log, r'"GET (/\S+\.jpg) HTTP') == Counter({f: 1 for f in jpegs(tiny_root)})

    records = read_ledger(ledger)
    assert sorted(records) == [(step, 0) for step in range(1, 13)]
    for epoch in (0, 1):
        seen = [i for r in records.values() if r["epoch"] == epoch for i in r["samples"]]
        assert sorted(seen) == list(range(120))

    from mlflow.tracking import MlflowClient
    client = MlflowClient(tracking_uri=f"sqlite:///{db}")
    run, = client.search_runs([client.get_experiment_by_name("goodput-trainer").experiment_id])
    metrics = run.data.metrics
    train_bytes = sum(p.stat().st_size for p in (tiny_root / "train").rglob("*.jpg"))
    assert metrics["data/volume_bytes"] == train_bytes  # rank 0's reads: each file once
    assert metrics["data/cache_hit_ratio"] == 1.0  # the last window: all from the cache
    assert metrics["data/bad_files"] == 0
    for key in ("data/fetch_seconds", "data/fetch_seconds_p99", "data/first_batch_seconds"):
        assert key in metrics


def test_an_unreachable_volume_is_one_clear_line(tmp_path):
    url = f"http://127.0.0.1:{free_port()}/imagenet"  # nothing listens there
    result = run_train(["+experiment=resnet", *tiny_overrides(url), "logger=none",
                        "data.read_retries=1", "data.retry_backoff_seconds=0.01"],
                       cwd=tmp_path)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: listing"), lines
    assert "failed 2 times" in lines[0] and "is reachable" in lines[0]

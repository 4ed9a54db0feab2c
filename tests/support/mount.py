"""A real network volume on loopback, FUSE-mounted (tests that use it are marked `mount`)."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional

import pytest

from support.launch import free_port, port_open, wait_for


@contextmanager
def rclone_mount(served: Path, mountpoint: Path, cache_mode: str = "off",
                 server_log: Optional[Path] = None) -> Iterator[Path]:
    """`rclone serve webdav` of `served`, FUSE-mounted at `mountpoint` with `rclone mount`
    (`cache_mode`: rclone's --vfs-cache-mode)."""
    if not shutil.which("rclone") or not os.path.exists("/dev/fuse"):
        pytest.fail("rclone and FUSE are required: apt-get install rclone fuse3 (.ci/run does)")
    port = free_port()
    log_args = ["-vv", "--log-file", str(server_log)] if server_log else []
    server = subprocess.Popen(["rclone", "serve", "webdav", str(served),
                               "--addr", f"127.0.0.1:{port}", *log_args],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    mountpoint.mkdir(parents=True, exist_ok=True)
    try:
        started = time.monotonic()
        wait_for(lambda: port_open(port), "rclone's WebDAV server to answer", timeout=30,
                 proc=server)
        subprocess.run(["rclone", "mount", ":webdav:", str(mountpoint),
                        "--webdav-url", f"http://127.0.0.1:{port}",
                        "--vfs-cache-mode", cache_mode, "--dir-cache-time", "0s",
                        "--cache-dir", str(mountpoint.parent / f".{mountpoint.name}-vfs"),
                        "--daemon"], check=True, timeout=60)
        wait_for(lambda: os.path.ismount(mountpoint), f"rclone's mount at {mountpoint}",
                 timeout=max(1.0, 30 - (time.monotonic() - started)))
        yield mountpoint
    finally:
        subprocess.run(["fusermount", "-uz", str(mountpoint)], capture_output=True)
        server.terminate()
        server.wait(timeout=30)

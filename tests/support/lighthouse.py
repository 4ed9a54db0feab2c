"""A real torchft lighthouse on loopback, for the in-band recovery tests and benchmark."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Iterator, Optional

import pytest

from support.launch import free_port, port_open, wait_for


def start_lighthouse(port: int, log: Optional[Path] = None,
                     join_timeout_ms: int = 2000) -> subprocess.Popen:
    """A torchft lighthouse on 127.0.0.1:`port`, listening once this returns; a dead replica
    is noticed after 1 s."""
    with open(log or os.devnull, "w") as out:
        proc = subprocess.Popen([shutil.which("torchft_lighthouse") or "torchft_lighthouse",
                                 "--min_replicas", "1", "--quorum_tick_ms", "100",
                                 "--join_timeout_ms", str(join_timeout_ms),
                                 "--heartbeat_timeout_ms", "1000",
                                 "--bind", f"127.0.0.1:{port}"],
                                stdout=out, stderr=out, start_new_session=True)
    wait_for(lambda: port_open(port), "the lighthouse to listen", timeout=30, proc=proc)
    return proc


@pytest.fixture
def lighthouse(tmp_path: Path) -> Iterator[str]:
    """A lighthouse for the test, which must outlive it."""
    port = free_port()
    proc = start_lighthouse(port, tmp_path / "lighthouse.log")
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        died = proc.poll()
        proc.kill()
        proc.wait()
        assert died is None, f"the lighthouse died during the test (exit {died})"

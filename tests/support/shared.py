"""Expensive fixtures made once per test session, whether it runs in one process or in
pytest-xdist's workers (`-n`), which are separate processes with temp dirs of their own."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Callable

import pytest
from filelock import FileLock

DONE = ".made"


def session_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory all processes of this session share: under xdist, the parent of the
    workers' own temp dirs (xdist's documented recipe); run alone, this process's one."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def made_once(tmp_path_factory: pytest.TempPathFactory, name: str,
              make: Callable[[Path], object]) -> Path:
    """`session_dir/name`, filled by `make(path)` in the first process that asks for it;
    the others wait on its lock and reuse it. A `make` that failed leaves no marker, so
    the next process tries again (and fails the same way, with its own error)."""
    shared = session_dir(tmp_path_factory)
    path = shared / name
    with FileLock(str(shared / f"{name}.lock")):
        if not (path / DONE).exists():
            shutil.rmtree(path, ignore_errors=True)
            path.mkdir()
            make(path)
            (path / DONE).touch()
    return path

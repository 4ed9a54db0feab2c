"""A full disk under the run directory (not the checkpoint dir): the final weights are
written whole or not at all and the run ends with one line, exit 2; the reports written
along the way (goodput.json, health.json) only warn, and training goes on."""

from __future__ import annotations

import errno
import logging
import os
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO, Iterator

import pytest
import torch

from common import files
from train import app
from train.records import goodput
from train.recovery import health
from train.config import HealthConfig
from train.errors import ConfigError
from train.records.goodput import Goodput
from train.recovery.health import HealthMonitor, HealthState
from support.logs import our_records

NO_SPACE = [errno.ENOSPC, errno.EDQUOT]


class FillsUp:
    """A file that takes `room` bytes, then fails the way a full disk does."""

    def __init__(self, f: BinaryIO, room: int, code: int) -> None:
        self.f, self.room, self.code = f, room, code

    def write(self, data: bytes) -> int:
        if len(data) > self.room:
            self.f.write(data[:self.room])
            self.room = 0
            raise OSError(self.code, os.strerror(self.code))
        self.room -= len(data)
        return self.f.write(data)

    def flush(self) -> None:
        self.f.flush()


def full_after(room: int, code: int):
    @contextmanager
    def atomic_file(path: Path) -> Iterator[FillsUp]:
        with files.atomic_file(path) as f:
            yield FillsUp(f, room, code)
    return atomic_file


def weights(n: int) -> dict:
    return {"w": torch.arange(n, dtype=torch.float32)}


@pytest.mark.parametrize("code", NO_SPACE)
@pytest.mark.parametrize("room", [0, 100, 5000])  # before, in and after the header
def test_a_full_disk_keeps_the_previous_final_weights_and_is_one_line(tmp_path, monkeypatch,
                                                                      code, room):
    path = tmp_path / "model_final.pt"
    app.save_final_weights(weights(10), path)
    monkeypatch.setattr(app, "atomic_file", full_after(room, code))
    with pytest.raises(ConfigError, match="no space left on device at .* for model_final.pt"):
        app.save_final_weights(weights(100_000), path)
    assert torch.equal(torch.load(path)["w"], weights(10)["w"])  # the good one, whole
    assert os.listdir(tmp_path) == ["model_final.pt"]  # no temp file taking room


def test_a_full_disk_at_fsync_is_reported_too(tmp_path, monkeypatch):
    def no_room(fd: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(files.os, "fsync", no_room)
    with pytest.raises(ConfigError, match="no space left"):
        app.save_final_weights(weights(10), tmp_path / "model_final.pt")
    assert os.listdir(tmp_path) == []


def test_other_write_errors_are_not_passed_off_as_a_full_disk(tmp_path, monkeypatch):
    monkeypatch.setattr(app, "atomic_file", full_after(100, errno.EIO))
    with pytest.raises((OSError, RuntimeError)) as caught:
        app.save_final_weights(weights(100_000), tmp_path / "model_final.pt")
    assert not isinstance(caught.value, ConfigError)


def failing_atomic_write(code: int):
    def atomic_write(path: Path, data: bytes) -> None:
        raise OSError(code, os.strerror(code))
    return atomic_write


@pytest.mark.parametrize("code", NO_SPACE)
def test_reports_that_cannot_be_written_only_warn(tmp_path, monkeypatch, caplog, code):
    monkeypatch.setattr(goodput, "atomic_write", failing_atomic_write(code))
    monkeypatch.setattr(health, "atomic_write", failing_atomic_write(code))
    monitor = HealthMonitor(HealthConfig(), HealthState(5), 0, tmp_path, replicated=False)
    with caplog.at_level(logging.WARNING):
        Goodput(tmp_path / "goodput.json", 0.0).save(ended=True)
        monitor.skip(7)
    assert monitor.skipped(7)
    warnings = [r.getMessage() for r in our_records(caplog) if r.levelno == logging.WARNING]
    assert len(warnings) == 2 and "goodput.json" in warnings[0] and "health.json" in warnings[1]
    assert not any(r.exc_info for r in our_records(caplog))

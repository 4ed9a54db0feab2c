"""What tests read of the log: the records of this project's own loggers only.

`caplog` captures more than the records that reach the root logger: pytest 9.2 also puts its
handlers on loggers that do not propagate, torch's DCP logger among them, so the records a
library logs (and how many) depend on which releases resolved. A test counts ours."""

from __future__ import annotations

import logging
from typing import List

import pytest

OURS = ("train", "data", "checkpointing", "common", "hydra_plugins")


def our_records(caplog: pytest.LogCaptureFixture) -> List[logging.LogRecord]:
    return [r for r in caplog.records if r.name.split(".")[0] in OURS]

"""Retrying an action that fails now and then, with exponential backoff."""

from __future__ import annotations

import time
from typing import Callable, TypeVar

T = TypeVar("T")


def retry(action: Callable[[], T], attempts: int, base_delay_s: float,
          is_transient: Callable[[Exception], bool]) -> T:
    """`action()`, called up to `attempts` times (at least once) while it raises an error
    that `is_transient` accepts, sleeping `base_delay_s * 2**i` after the i-th failure
    (from 0). Any other error, or the last attempt's, propagates unchanged."""
    for attempt in range(attempts - 1):
        try:
            return action()
        except Exception as err:
            if not is_transient(err):
                raise
        time.sleep(base_delay_s * 2 ** attempt)
    return action()

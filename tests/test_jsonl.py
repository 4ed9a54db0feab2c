"""The readers of run files (common/jsonl.py, read_goodput) against files that are not what
they should be."""

import os
import signal
from pathlib import Path

import pytest

from common import jsonl
from common.run_files import read_goodput


class Blocked(Exception):
    pass


@pytest.fixture
def no_hang():
    """A call that blocks (a FIFO's open or read, /dev/zero's endless line) fails the test
    instead of hanging the suite."""
    def hung(*_):
        raise Blocked()  # not an OSError, which the test expects
    old = signal.signal(signal.SIGALRM, hung)
    signal.setitimer(signal.ITIMER_REAL, 10, 1)
    yield
    signal.setitimer(signal.ITIMER_REAL, 0)
    signal.signal(signal.SIGALRM, old)


def _fifo(path: Path) -> Path:
    os.mkfifo(path)
    return path


def _device(path: Path) -> Path:
    path.symlink_to("/dev/zero")
    return path


def _directory(path: Path) -> Path:
    path.mkdir()
    return path


@pytest.mark.parametrize("make", [_fifo, _device, _directory])
def test_a_file_that_is_not_a_regular_file_is_refused_not_waited_on(tmp_path, no_hang, make):
    """A reader takes a FIFO as a stream (tests/test_report.py feeds one), nothing else."""
    path = make(tmp_path / "events.jsonl")
    if make is not _fifo:
        with pytest.raises(OSError):
            list(jsonl.records(path))
    with pytest.raises(OSError):
        jsonl.append_line(path, {"a": 1})
    assert read_goodput(path) == (None, f"{path.name} cannot be read (not a regular file)")


def test_hostile_lines_are_skipped_and_a_link_to_a_file_is_read(tmp_path, no_hang):
    target = tmp_path / "real.jsonl"
    target.write_bytes(b'{"a":1}\n' + b"[" * 70000 + b"\n" + b'\xff\xfe{"x"\n'
                       + b'{"n":' + b"9" * 6000 + b"}\n" + b"x" * 200000 + b'\n{"d":2}')
    link = tmp_path / "events.jsonl"
    link.symlink_to(target)
    assert list(jsonl.records(link)) == [{"a": 1}, {"d": 2}]
    jsonl.append_line(link, {"e": 3})  # the torn-looking last line gets its own newline
    assert list(jsonl.records(target)) == [{"a": 1}, {"d": 2}, {"e": 3}]

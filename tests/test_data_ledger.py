"""The audit ledger: one append per line from concurrent processes, torn tails, re-records."""

from __future__ import annotations

import json
import multiprocessing
import tracemalloc
from pathlib import Path

from data.ledger import LedgerWriter, read_ledger

STEPS = 150
SAMPLES = list(range(100000, 101500))  # ~10 KB lines: larger than a pipe's atomic write


def _write_steps(path: Path, rank: int) -> None:
    writer = LedgerWriter(path, rank)
    for step in range(1, STEPS + 1):
        writer.record(step, step // 50, SAMPLES, 1.0 / (step + rank))
    writer.close()


def test_concurrent_ranks_never_interleave_lines(tmp_path):
    path = tmp_path / "ledger.jsonl"
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_write_steps, args=(path, rank)) for rank in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
        assert p.exitcode == 0
    # A writer that opens while another's append is in flight may see no newline at the end
    # and end the "torn" line itself: a blank line, which readers skip (data/ledger.py).
    lines = [line for line in path.read_bytes().splitlines() if line.strip()]
    assert len(lines) == 4 * STEPS
    records = [json.loads(line) for line in lines]  # every line is one whole record
    assert {(r["step"], r["rank"]) for r in records} == {
        (s, r) for s in range(1, STEPS + 1) for r in range(4)}
    record = read_ledger(path)[(7, 2)]
    assert record["samples"] == SAMPLES and float.fromhex(record["loss"]) == 1.0 / 9


def test_a_torn_tail_is_ignored_and_a_recomputed_step_counts_by_its_last_record(tmp_path):
    path = tmp_path / "ledger.jsonl"
    writer = LedgerWriter(path, 0)
    for step in (1, 2, 3):
        writer.record(step, 0, [step], float(step))
    writer.close()
    whole = path.read_bytes()
    torn = b'{"step":4,"rank":0,"epoch":0,"samp'
    path.write_bytes(whole + torn)  # a crash in the middle of step 4's line
    assert sorted(read_ledger(path)) == [(1, 0), (2, 0), (3, 0)]

    # The resumed run restarts after step 2's checkpoint: steps 3 and 4 are recomputed.
    writer = LedgerWriter(path, 0)
    writer.record(3, 0, [30], 3.5)
    writer.record(4, 0, [40], 4.5)
    writer.close()
    records = read_ledger(path)
    assert sorted(records) == [(1, 0), (2, 0), (3, 0), (4, 0)]
    assert records[(3, 0)]["samples"] == [30] and records[(4, 0)]["samples"] == [40]
    assert float.fromhex(records[(3, 0)]["loss"]) == 3.5
    # The control: the torn bytes are still in the file, on a line of their own.
    assert torn + b"\n" in path.read_bytes()


HUGE = 64 << 20  # a line of garbage with no newline, far longer than any record


def peak_bytes(read) -> int:
    """The most memory Python held at once while `read()` ran."""
    tracemalloc.start()
    try:
        read()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_a_huge_garbage_line_is_skipped_unread_and_the_records_around_it_kept(tmp_path):
    """The ledger is hostile input when read back: its reader held a whole line in memory,
    so a file of garbage without a newline cost its size in memory."""
    path = tmp_path / "ledger.jsonl"
    with LedgerWriter(path, 0) as writer:
        writer.record(1, 0, SAMPLES, 1.0)
    with open(path, "ab") as f:
        f.write(b"x" * HUGE + b"\n")
    with LedgerWriter(path, 0) as writer:
        writer.record(2, 0, SAMPLES, 2.0)
    found = {}
    assert peak_bytes(lambda: found.update(read_ledger(path))) < HUGE // 4
    assert sorted(found) == [(1, 0), (2, 0)]

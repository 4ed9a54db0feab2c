"""Checkpoints across world sizes (torchrun, gloo): every rank writes its shard and marker,
all ranks load the same step, and a checkpoint saved at W ranks loads at W' ranks."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from checkpointing import commit
from checkpointing.storage import Store
from support.launch import run, torchrun
from support.runs import REPO

WORKER = REPO / "tests" / "workers" / "checkpoint_worker.py"


def run_worker(ranks: int, mode: str, ckpt: Path, out: Path) -> list:
    """tests/workers/checkpoint_worker.py under torchrun; each rank's report."""
    out.mkdir(parents=True, exist_ok=True)
    result = run(torchrun(ranks), [str(WORKER), mode, str(ckpt), str(out)], timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(ranks)]


@pytest.fixture(scope="module")
def saved_at_two_ranks(tmp_path_factory):
    root = tmp_path_factory.mktemp("multirank")
    reports = run_worker(2, "save", root / "ckpt", root / "save")
    return root, reports


def test_replicated_buffers_are_synced_from_rank_0_before_staging(saved_at_two_ranks):
    root, saved = saved_at_two_ranks
    rank0_before = json.loads((root / "save" / "rank0-before.json").read_text())
    # Both ranks hold rank 0's statistics after the save, so whichever copy DCP wrote...
    assert saved[0]["running_mean"] == saved[1]["running_mean"] == rank0_before


def test_two_ranks_commit_one_checkpoint_with_a_marker_each(saved_at_two_ranks):
    root, _ = saved_at_two_ranks
    store = Store(str(root / "ckpt"))
    assert list(commit.find_complete(store)) == [(7, 2)]
    names = set(os.listdir(root / "ckpt" / "step_000000007"))
    assert {"commit_rank_0.json", "commit_rank_1.json", ".metadata"} <= names


@pytest.mark.parametrize("ranks", [1, 2, 3])
def test_a_checkpoint_saved_at_two_ranks_loads_at_any_world_size(saved_at_two_ranks, tmp_path,
                                                                  ranks):
    root, saved = saved_at_two_ranks
    loaded = run_worker(ranks, "load", root / "ckpt", tmp_path)
    for report in loaded:
        assert report["step"] == 7
        for key in ("weight_sum", "running_mean", "exp_avg_sum"):
            assert report[key] == saved[0][key], key  # ...a load sees rank 0's
    draws = [r["next_random"] for r in loaded]
    saved_draws = [r["next_random"] for r in saved]
    if ranks == 2:  # same world size: each rank continues its own saved RNG stream
        assert draws == saved_draws
    else:  # the streams do not map onto ranks: they are left out, no rank continues one
        assert not [d for d in draws if d in saved_draws], (draws, saved_draws)


def test_each_rank_reads_its_share_of_a_checkpoint_to_verify_it(saved_at_two_ranks, tmp_path):
    """Resume's check of every checksum is spread over the ranks (rank 0 alone would read
    a whole 1 B-parameter state, 12 GB with AdamW); they agree on the verdict."""
    root, _ = saved_at_two_ranks
    reports = run_worker(2, "discover", root / "ckpt", tmp_path)
    assert [r["complete"] for r in reports] == [[[7, 2]], [[7, 2]]]
    listed = set(commit.verified_files(Store(str(root / "ckpt")), "step_000000007", 7)[1])
    shares = [{Path(p).name for p in r["read"]} for r in reports]
    assert shares[0] and shares[1] and not shares[0] & shares[1], shares
    assert shares[0] | shares[1] == listed


def test_each_rank_checks_its_own_upload_and_rank_0_downloads_none_of_the_others(tmp_path):
    """Through a staging tier, each rank reads back only the files it uploaded; retention
    on rank 0 trusts them rather than reading every rank's files back at every save."""
    reports = run_worker(2, "save-staged", tmp_path / "ckpt", tmp_path / "out")
    store = Store(str(tmp_path / "ckpt"))
    assert [s for s, _ in commit.find_complete(store)] == [8, 7]
    for rank, report in enumerate(reports):
        uploaded = [name for step in (7, 8) for name in json.loads(
            (tmp_path / "ckpt" / commit.step_dir_name(step) / commit.marker_name(rank))
            .read_text())["files"]]
        assert sorted(Path(p).name for p in report["read"]) == sorted(uploaded), (rank, report)


def test_a_resume_from_one_nodes_staging_copy_shares_its_checksums_too(tmp_path):
    """The node's ranks read one local copy: each checks its share of it, as of the
    durable copy, instead of each reading all of it (8 x the checkpoint on an 8-GPU node)."""
    run_worker(2, "save-staged", tmp_path / "ckpt", tmp_path / "out")
    reports = run_worker(2, "load-staged", tmp_path / "ckpt", tmp_path / "out")
    assert [r["step"] for r in reports] == [8, 8]
    listed = commit.verified_files(Store(str(tmp_path / "ckpt")), "step_000000008", 8)[1]
    for root in (tmp_path / "ckpt", tmp_path / "out" / "stage"):  # durable, then local
        shares = [{Path(p).name for p in r["read"] if Path(p).parent.parent == root}
                  for r in reports]
        assert shares[0] and shares[1] and not shares[0] & shares[1], (root, shares)
        assert shares[0] | shares[1] == set(listed), (root, shares)


@pytest.mark.parametrize("reader", [0, 1])
def test_a_file_altered_in_any_ranks_share_fails_the_checkpoint_on_every_rank(
        saved_at_two_ranks, tmp_path, reader):
    root, _ = saved_at_two_ranks
    ckpt = tmp_path / "ckpt"
    shutil.copytree(root / "ckpt", ckpt)
    listed = commit.verified_files(Store(str(ckpt)), "step_000000007", 7)[1]
    victim = commit.share_of(listed, reader, 2)[0]
    path = ckpt / "step_000000007" / victim
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    reports = run_worker(2, "discover", ckpt, tmp_path / "out")
    assert [r["complete"] for r in reports] == [[], []]
    assert len(reports[0]["warnings"]) == 1, reports[0]["warnings"]
    assert f"{victim} does not match its checksum" in reports[0]["warnings"][0]
    assert reports[1]["warnings"] == []  # one line, from rank 0


@pytest.mark.parametrize("name,present", [("y\nINFO resumed from step 99", True),
                                          ("x\nWARNING forged" + "n" * 1_000_000, False)])
def test_a_name_a_marker_lists_is_one_short_line_in_the_warning(saved_at_two_ranks, tmp_path,
                                                                  name, present):
    """A marker may list any name: a newline in it would forge a log line of its own (the
    file there, its checksum wrong, or missing), a megabyte of name a megabyte warning."""
    root, _ = saved_at_two_ranks
    ckpt = tmp_path / "ckpt"
    shutil.copytree(root / "ckpt", ckpt)
    step_dir = ckpt / "step_000000007"
    if present:
        (step_dir / name).write_bytes(b"abc")
    marker = step_dir / "commit_rank_1.json"
    body = json.loads(marker.read_text())
    body["files"][name] = {"size": 3, "xxh3_64": "0" * 16}
    marker.write_text(json.dumps(body))
    reports = run_worker(2, "discover", ckpt, tmp_path / "out")
    assert [r["complete"] for r in reports] == [[], []]
    [warning] = reports[0]["warnings"]
    assert "\n" not in warning and len(warning) < 500, warning[:1000]
    assert ("y\\nINFO resumed" if present else "x\\nWARNING forged") in warning
    assert reports[1]["warnings"] == []


@pytest.mark.parametrize("swap", ["fifo", "zero"])
def test_a_file_swapped_after_rank_0_listed_it_fails_the_checkpoint_on_every_rank(
        saved_at_two_ranks, tmp_path, swap):
    """Rank 1 reads its share after rank 0's listing: a FIFO put there meanwhile blocked its
    open, a link to /dev/zero its read, for good (and rank 0 timed out in the all-reduce).
    Such a file could not be read, on every rank, and the older checkpoint is used."""
    root, _ = saved_at_two_ranks
    ckpt = tmp_path / "ckpt"
    shutil.copytree(root / "ckpt", ckpt)
    older = ckpt / "step_000000005"
    shutil.copytree(ckpt / "step_000000007", older)
    for marker in older.glob("commit_rank_*.json"):
        marker.write_text(json.dumps({**json.loads(marker.read_text()), "step": 5}))
    reports = run_worker(2, f"discover-{swap}", ckpt, tmp_path / "out")
    assert [r["complete"] for r in reports] == [[[5, 2]], [[5, 2]]]
    swapped = Path(reports[1]["read"][0])
    assert swapped.parent.name == "step_000000007"
    [warning] = reports[0]["warnings"]
    assert f"step_000000007 is incomplete ({swapped.name} could not be read)" in warning
    assert reports[1]["warnings"] == []


def test_a_store_rank_0_cannot_list_is_one_error_on_every_rank(saved_at_two_ranks, tmp_path):
    """Not a hang of the other ranks in the broadcast of what rank 0 found (until the
    collective's timeout killed the job)."""
    root, _ = saved_at_two_ranks
    reports = run_worker(2, "discover-unlistable", root / "ckpt", tmp_path)
    assert reports[0] == reports[1], reports
    assert reports[0]["error"].startswith(f"cannot list the checkpoints in {root / 'ckpt'} "
                                          f"(OSError: [Errno 5] Input/output error")


def test_a_marker_survives_rank_0_committing_its_directory_the_moment_it_appears(
        tmp_path, monkeypatch):
    """Rank 0 renames the partial directory as soon as the last marker is visible, which
    can be before the rank that wrote it has made the rename durable (CI saw rank 1's final
    save fail with FileNotFoundError). Played here in one process: the directory is
    committed from under the writer right after its marker lands."""
    store = Store(str(tmp_path))
    partial, final = ".step_000000012.partial-a-b", commit.step_dir_name(12)
    store.makedirs(store.path(partial))
    replace = os.replace

    def replace_then_commit(src, dst):
        replace(src, dst)
        os.rename(tmp_path / partial, tmp_path / final)

    monkeypatch.setattr(os, "replace", replace_then_commit)
    commit.write_marker(store, partial, 12, 1, 2, {})
    assert commit.markers_present(store, final) == [1]

"""strategy=ddp_ft: in-band recovery on torchft, with real processes and real kills. Two
replica groups (one torchrun job each) train under a real lighthouse; one is SIGKILLed; the
other goes on alone without restarting, the killed one rejoins by healing from it, and the
audit ledger shows every sample of every epoch trained exactly once."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import pytest
import torch

pytest.importorskip("torchft", reason="the ft extra: pip install -e '.[ft]'")

from data.sampler import split_bounds  # noqa: E402
from support.launch import finish, free_port, launch, torchrun, trainers, wait_for  # noqa: E402
from support.ledger import assert_exactly_once, ledger_records, surviving_history  # noqa: E402
from support.lighthouse import lighthouse, start_lighthouse  # noqa: E402,F401  (a fixture)
from support.runs import train_args  # noqa: E402
from common.redact import strip_credentials  # noqa: E402
from train.recovery.replicas import (apply_means, checksum_slots, drift_of, identity_of, judge,  # noqa: E402
                      read_checksums, spans, weighted_sums)

KILLED_AT = 3  # the step whose start, or whose all-reduce, kills group 1


def start_group(tiny_root: Path, run_root: Path, lighthouse: str, replica: int, fault: str,
                max_restarts: int = 0, groups: int = 2, extra: Sequence[str] = (),
                nproc: int = 1) -> subprocess.Popen:
    args = train_args(tiny_root, run_root, f"strategy.fault_tolerance.lighthouse={lighthouse}",
                      f"strategy.fault_tolerance.replica_id={replica}",
                      f"strategy.fault_tolerance.replica_groups={groups}",
                      "strategy.fault_tolerance.timeout_seconds=10",
                      "strategy.fault_tolerance.quorum_timeout_seconds=5",
                      "strategy.fault_tolerance.connect_timeout_seconds=5", *extra,
                      strategy="ddp_ft")
    return launch(torchrun(nproc, max_restarts=max_restarts), args, fault=fault,
                  log=run_root / f"group{replica}.log")


def ended(proc: subprocess.Popen, run_root: Path, replica: int, timeout: float = 180) -> str:
    """Wait for group `replica`'s torchrun job; what it wrote to its log."""
    finish(proc, timeout=timeout)
    return (run_root / f"group{replica}.log").read_text()


def trainer_pid(run_root: Path, replica: int) -> Optional[int]:
    """The live trainer process of replica group `replica` (not its torchrun agent)."""
    return next(iter(trainers(run_root, f"replica_id={replica}\0".encode())), None)


def events_of(run_root: Path, replica: int) -> List[dict]:
    path = run_root / "r" / f"replica_{replica}" / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def kinds(run_root: Path, replica: int) -> List[str]:
    """The kinds of the events replica group `replica` recorded so far."""
    if not (run_root / "r" / f"replica_{replica}" / "events.jsonl").exists():
        return []
    return [e["kind"] for e in events_of(run_root, replica)]


def final_weights(run_root: Path, replica: int) -> Dict[str, torch.Tensor]:
    return torch.load(run_root / "r" / f"replica_{replica}" / "model_final.pt",
                      weights_only=True)


@pytest.mark.parametrize("kill", [f"kill:step={KILLED_AT}",
                                  f"kill:at=allreduce:step={KILLED_AT}"],
                         ids=["step", "allreduce"])
def test_a_killed_group_rejoins_live_and_no_sample_is_lost_or_doubled(
        tiny_root: Path, tmp_path: Path, lighthouse: str, kill: str) -> None:
    # Steps at reduced width are slowed, so the survivor is still training when the killed
    # group is back (a restart takes seconds on a busy machine).
    survivor = start_group(tiny_root, tmp_path, lighthouse, 0, "delay:ms=2500")
    victim = start_group(tiny_root, tmp_path, lighthouse, 1, f"delay:ms=2500;{kill}",
                         max_restarts=1)
    wait_for(lambda: trainer_pid(tmp_path, 0), "group 0's trainer", proc=survivor)
    pid = trainer_pid(tmp_path, 0)
    ledger = tmp_path / "ledger.jsonl"
    wait_for(lambda: "heal" in kinds(tmp_path, 1)[1:][kinds(tmp_path, 1)[1:].index("start"):]
             if "start" in kinds(tmp_path, 1)[1:] else False,
             "the restarted group to heal from the survivor", timeout=180, proc=survivor)
    assert trainer_pid(tmp_path, 0) == pid, "the survivor was restarted"
    for replica, proc in enumerate((survivor, victim)):
        out = ended(proc, tmp_path, replica)
        assert proc.returncode == 0, out[-3000:]
    alone = {r["step"] for r in ledger_records(ledger) if r["world"] == 1}
    assert alone and max(alone) > KILLED_AT, "the survivor did not go on alone"

    # Not lost, not doubled: the killed step committed once, at the width that was left.
    killed_step = [r for r in ledger_records(ledger) if r["step"] == KILLED_AT]
    assert [(r["rank"], r["world"]) for r in killed_step] == [(0, 1)], killed_step
    assert_exactly_once(ledger)
    assert kinds(tmp_path, 0).count("start") == 1
    assert kinds(tmp_path, 1).count("start") == 2
    ours, theirs = final_weights(tmp_path, 0), final_weights(tmp_path, 1)
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert any(len(records) == 2 for records in surviving_history(ledger).values())


@pytest.mark.parametrize("fault", ["", "static_split"], ids=["resplit", "static_split"])
def test_a_group_alone_trains_the_whole_global_batch(tiny_root: Path, tmp_path: Path,
                                                     lighthouse: str, fault: str) -> None:
    """One of two groups runs the whole job at half width: the re-split gives it every
    sample. The negative control keeps each group's fixed half (what torchft's own sampler
    does), and the ledger check catches the half that nobody trained."""
    group = start_group(tiny_root, tmp_path, lighthouse, 0, fault)
    out = ended(group, tmp_path, 0)
    assert group.returncode == 0, out[-3000:]
    # Its own log and Hydra record, in its own directory (as its checkpoints and timeline).
    assert not (tmp_path / "r" / "train.log").exists()
    assert "replica group 0 joined" in (tmp_path / "r" / "replica_0" / "train.log").read_text()
    assert (tmp_path / "r" / "replica_0" / ".hydra" / "latest" / "config.yaml").exists()
    # Its final weights are its own, which it says once, and the goodput report too.
    assert out.count("replica group 0 trained steps 1-12 alone, and no other group took part "
                     "after them") == 1, out[-3000:]
    assert "trained alone at the end: steps 1-12 (no other replica group" in out
    if fault:
        with pytest.raises(AssertionError):
            assert_exactly_once(tmp_path / "ledger.jsonl")
    else:
        assert_exactly_once(tmp_path / "ledger.jsonl")


def test_without_the_lighthouse_the_groups_stop_and_resume_from_checkpoints(
        tiny_root: Path, tmp_path: Path) -> None:
    port = free_port()
    address = f"http://127.0.0.1:{port}"
    group = start_group(tiny_root, tmp_path, address, 0, "", groups=1)
    out = ended(group, tmp_path, 0)
    assert group.returncode == 1, out[-3000:]
    assert f"error: cannot join the torchft lighthouse at {address}" in out
    # The lighthouse comes back mid-run, dies, comes back: the checkpoint path takes over.
    lighthouse = start_lighthouse(port, join_timeout_ms=1000)
    try:
        group = start_group(tiny_root, tmp_path, address, 0, "", groups=1)
        ledger = tmp_path / "ledger.jsonl"
        wait_for(lambda: (tmp_path / "r" / "checkpoints" / "replica_0").exists() and any(
            r["step"] >= 5 for r in ledger_records(ledger)), "a checkpoint", proc=group)
        lighthouse.kill()
        lighthouse.wait()
        out = ended(group, tmp_path, 0)
        assert group.returncode == 1, out[-3000:]
        assert f"error: no quorum from the torchft lighthouse at {address}" in out
        lighthouse = start_lighthouse(port, join_timeout_ms=1000)
        group = start_group(tiny_root, tmp_path, address, 0, "", groups=1)
        out = ended(group, tmp_path, 0)
        assert group.returncode == 0, out[-3000:]
    finally:
        lighthouse.kill()
        lighthouse.wait()
    assert "resume" in kinds(tmp_path, 0)
    assert_exactly_once(ledger)


def test_a_group_that_trains_something_else_is_refused_at_join(
        tiny_root: Path, tmp_path: Path, lighthouse: str) -> None:
    """Of three groups, group 2 comes with another seed (the groups would slice two
    permutations), learning rate and batch size: it is refused before it trains or heals,
    with one line naming the keys, exit 2; the other two (whose keys differ only where that
    does not change what is trained) train together. min_replicas=2 on every group, and
    group 2 waiting first: it is in the first quorum the others form, where the lowest
    replica id is the reference (all at step 0)."""
    wait = ["strategy.fault_tolerance.min_replicas=2", "trainer.max_steps=6",
            "strategy.fault_tolerance.quorum_timeout_seconds=60"]
    extras = [wait, [*wait, "trainer.log_every_steps=3", "checkpoint.interval_steps=3"],
              [*wait, "seed=7", "optim.lr=0.5", "data.global_batch_size=30"]]
    groups = {2: start_group(tiny_root, tmp_path, lighthouse, 2, "", groups=3, extra=extras[2])}
    wait_for(lambda: "waiting up to 60s" in (tmp_path / "group2.log").read_text(),
             "group 2 to wait for more groups", proc=groups[2])
    groups.update({replica: start_group(tiny_root, tmp_path, lighthouse, replica, "",
                                        groups=3, extra=extras[replica]) for replica in (0, 1)})
    out = ended(groups[2], tmp_path, 2)
    assert [e["code"] for e in events_of(tmp_path, 2) if e["kind"] == "exit"] == [2]
    assert "Traceback" not in out.split("error:")[0], out[-3000:]  # torchrun's own follows
    [line] = [line for line in out.splitlines() if "something else" in line]
    assert re.fullmatch(
        r"error: replica group 2 trains something else than replica group [01] \(at step \d+\) "
        r"under the same lighthouse: data.global_batch_size=30 here, 20 there; optim.lr=0.5 "
        r"here, 0.1 there; seed=7 here, 0 there\. Start every group with the same config "
        r"and as many ranks \(keys that do not change what is trained, such as "
        r"trainer.max_steps, data.num_workers or checkpoint.\*, may differ\)", line), line
    assert not ledger_records(tmp_path / "ledger.jsonl") or all(
        r["world"] == 2 for r in ledger_records(tmp_path / "ledger.jsonl"))
    outs = [ended(groups[replica], tmp_path, replica) for replica in (0, 1)]
    for replica, out in enumerate(outs):
        assert groups[replica].returncode == 0, out[-3000:]
    assert any("replica groups [2] train something else: refused, going on without them"
               in out for out in outs)
    ours, theirs = final_weights(tmp_path, 0), final_weights(tmp_path, 1)
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert_exactly_once(tmp_path / "ledger.jsonl", epochs=1)
    assert {r["world"] for r in ledger_records(tmp_path / "ledger.jsonl")} == {2}


def test_a_group_of_another_width_is_refused_at_join(
        tiny_root: Path, tmp_path: Path, lighthouse: str) -> None:
    """Group 0 of two ranks, group 1 of one, the same config: torchft pairs rank r of every
    group, so group 0's rank 1 has no peer (it used to wait out every timeout, and the
    ranks of group 0 disagreed on whether to train). Group 1, waiting first, is refused
    with one line, exit 2; group 0, every one of its ranks, goes on without it."""
    common = ["trainer.max_steps=6", "strategy.fault_tolerance.quorum_timeout_seconds=60"]
    lone = start_group(tiny_root, tmp_path, lighthouse, 1, "",
                       extra=[*common, "strategy.fault_tolerance.min_replicas=2"])
    wait_for(lambda: "waiting up to 60s" in (tmp_path / "group1.log").read_text(),
             "group 1 to wait for more groups", proc=lone)
    pair = start_group(tiny_root, tmp_path, lighthouse, 0, "", extra=common, nproc=2)
    out = ended(lone, tmp_path, 1, timeout=120)
    assert [e["code"] for e in events_of(tmp_path, 1) if e["kind"] == "exit"] == [2], out[-3000:]
    [line] = [line for line in out.splitlines() if "something else" in line]
    assert re.fullmatch(r"error: replica group 1 trains something else than replica group 0 "
                        r"\(at step 0\) under the same lighthouse: ranks per group=1 here, 2 "
                        r"there\. Start every group .*", line), line
    out = ended(pair, tmp_path, 0, timeout=120)
    assert pair.returncode == 0, out[-3000:]
    assert_exactly_once(tmp_path / "ledger.jsonl", epochs=1)
    assert {r["world"] for r in ledger_records(tmp_path / "ledger.jsonl")} == {2}


def test_a_corrupt_group_is_caught_and_every_group_rolls_back(
        tiny_root: Path, tmp_path: Path, lighthouse: str) -> None:
    """A silent parameter change in group 1 after step 3: the check of the state after step
    3, riding on step 4's all-reduce, catches it in both groups; both roll back to step 2
    (the last state the check matched) and end with bit-equal weights. Each group has its
    own train.log and .hydra/latest."""
    wait = ["strategy.fault_tolerance.min_replicas=2", "health.replica_check_steps=1",
            "trainer.max_steps=6"]  # min_replicas: both take part from step 1
    groups = [start_group(tiny_root, tmp_path, lighthouse, replica,
                          "corrupt:step=3" if replica else "", extra=wait)
              for replica in (0, 1)]
    for replica, proc in enumerate(groups):
        out = ended(proc, tmp_path, replica)
        assert proc.returncode == 0, out[-3000:]
        assert ("replica group checksum mismatch after step 3 (groups [1] differ from "
                "group 0): rolled back to step 2 (rollback 1") in out, out[-3000:]
        assert "alone" not in out
    ours, theirs = final_weights(tmp_path, 0), final_weights(tmp_path, 1)
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert_exactly_once(tmp_path / "ledger.jsonl", epochs=1)
    run_dir = tmp_path / "r"
    assert not (run_dir / "train.log").exists() and not (run_dir / ".hydra").exists()
    for replica in (0, 1):
        log = (run_dir / f"replica_{replica}" / "train.log").read_text()
        assert f"replica group {replica} joined" in log
        assert f"replica group {1 - replica} joined" not in log
        latest = run_dir / f"replica_{replica}" / ".hydra" / "latest"
        assert f"replica_id={replica}" in (latest / "overrides.yaml").read_text()


def test_a_lone_group_below_min_replicas_waits_then_exits_with_one_line(
        tiny_root: Path, tmp_path: Path, lighthouse: str) -> None:
    """min_replicas=2 and no second group: it used to redo step 1 thousands of times a
    minute, for ever. It waits, backing off, for quorum_timeout_seconds, then exits 1."""
    group = start_group(tiny_root, tmp_path, lighthouse, 0, "",
                        extra=["strategy.fault_tolerance.min_replicas=2",
                               "strategy.fault_tolerance.quorum_timeout_seconds=3"])
    out = ended(group, tmp_path, 0, timeout=90)
    assert group.returncode == 1, out[-3000:]
    [line] = [line for line in out.splitlines() if line.startswith("error:")]
    assert line == ("error: 1 of strategy.fault_tolerance.min_replicas=2 replica groups for 3s "
                    "(strategy.fault_tolerance.quorum_timeout_seconds): start the missing "
                    "groups, or lower strategy.fault_tolerance.min_replicas; this group "
                    "resumes from its checkpoint when run again")
    assert out.count("waiting up to 3s for a quorum that can train") == 1
    assert "did not commit" not in out and not ledger_records(tmp_path / "ledger.jsonl")


def test_weighted_sums_give_the_whole_batch_mean_however_it_is_split() -> None:
    """The arithmetic of the cross-group average, in one process: three uneven shares'
    addends, summed, give the gradient of the whole batch (no BatchNorm: its statistics
    legitimately depend on the split, docs/architecture.md)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.ReLU(), torch.nn.Linear(4, 3))
    x, y = torch.randn(20, 5), torch.randint(0, 3, (20,))

    def addends(lo: int, hi: int) -> torch.Tensor:
        model.zero_grad()
        torch.nn.functional.cross_entropy(model(x[lo:hi]), y[lo:hi]).backward()
        return weighted_sums(model, hi - lo)

    assert [split_bounds(20, p, 3) for p in range(3)] == [(0, 6), (6, 13), (13, 20)]
    apply_means(model, addends(0, 20))
    whole = [p.grad.clone() for p in model.parameters()]
    apply_means(model, sum(addends(*split_bounds(20, p, 3)) for p in range(3)))
    for split, reference in zip([p.grad for p in model.parameters()], whole):
        torch.testing.assert_close(split, reference)


def test_the_parameter_check_slots_carry_every_bit_of_a_checksum() -> None:
    """Checksums (int64, any sign) in fp32 slots, summed over the groups as the all-reduce
    does: every bit comes back, and a one-bit difference is named."""
    checksums = {0: -1, 3: 2**63 - 1, 7: -(2**63), 2: 0x0001_0000_FFFF_0001}
    summed = sum(checksum_slots(c, replica, slot, len(checksums), torch.device("cpu"))
                 for slot, (replica, c) in enumerate(checksums.items()))
    words = {r: c & (2**64 - 1) for r, c in checksums.items()}
    assert read_checksums(summed) == words
    assert drift_of({0: 5, 1: 5, 2: 5}, 9) is None
    assert drift_of({2: 5, 0: 5, 1: 4}, 9) == ("replica group checksum mismatch after step 9 "
                                               "(groups [1] differ from group 0)")


def test_the_group_furthest_ahead_sets_what_is_trained() -> None:
    same, other = {"seed": "0", "optim.lr": "0.1"}, {"seed": "0", "optim.lr": "0.5"}
    members = [{"replica_id": 0, "step": 3, "config": other},
               {"replica_id": 1, "step": 5, "config": same},
               {"replica_id": 2, "step": 5, "config": same}]
    assert judge(members, 1).others == (0,) and judge(members, 1).refused is None
    assert judge(members, 0).refused.startswith(
        "replica group 0 trains something else than replica group 1 (at step 5) under the "
        "same lighthouse: optim.lr=0.5 here, 0.1 there. ")
    tie = [{"replica_id": 4, "step": 0, "config": same},
           {"replica_id": 3, "step": 0, "config": {**other, "model.name": "x" * 99}}]
    refused = judge(tie, 4).refused  # a tie: the lowest id; a key absent, a long value
    assert "than replica group 3" in refused and "x" * 41 not in refused
    assert "model.name=(absent) here, " + "x" * 40 + " there" in refused
    many = [{"replica_id": 0, "step": 0, "config": {f"k{i}": "a" for i in range(8)}},
            {"replica_id": 1, "step": 0, "config": {f"k{i}": "b" for i in range(8)}}]
    assert "; 3 more. Start" in judge(many, 1).refused
    assert spans([7, 1, 3, 2, 9, 10]) == "1-3, 7, 9-10"


@pytest.mark.parametrize("root", [
    "s3://AKIAKEY:{secret}@minio:9000/bucket/data",
    "https://alice:{secret}@files.example.org/data",
    "https://{secret}@files.example.org/data",
    "az://box/data?sv=2024&sig={secret}"])
def test_no_credential_reaches_a_peer_or_the_refusal_line(root: str) -> None:
    """data.root with a secret in the URL, long enough that a 40-character cut drops its
    "@": the value a group publishes holds none, the same bucket read with another key is
    the same data (not refused), and a refusal over another key names no secret, before or
    after the error line's own stripping."""
    old, new = "oldSecretRotatedAwayXXXXXXXXXXXX", "wJalrXUtnFEMIK7MDENGbPxRfiCYEXAMPLE"
    ours = identity_of({"data.root": root.format(secret=new), "seed": 0})
    theirs = identity_of({"data.root": root.format(secret=old), "seed": 0})
    assert new not in json.dumps(ours) and ours == theirs and ours["seed"] == "0"
    members = [{"replica_id": 0, "step": 0, "config": {"data.root": root.format(secret=new)}},
               {"replica_id": 1, "step": 0,
                "config": {"data.root": root.format(secret=old).replace("data", "other")}}]
    refused = judge(members, 1).refused
    assert "data.root=" in refused
    for secret in (old, new):
        for text in (refused, strip_credentials(refused)):
            assert secret[:8] not in text, text

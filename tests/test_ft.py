"""strategy=ddp_ft: in-band recovery on torchft, with real processes and real kills. Two
replica groups (one torchrun job each) train under a real lighthouse; one is SIGKILLed; the
other goes on alone without restarting, the killed one rejoins by healing from it, and the
audit ledger shows every sample of every epoch trained exactly once."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Dict, Iterator, List, Optional

import pytest
import torch

pytest.importorskip("torchft", reason="the ft extra: pip install -e '.[ft]'")

from data.sampler import split_bounds  # noqa: E402
from support.launch import finish, free_port, launch, port_open, torchrun, wait_for  # noqa: E402
from support.ledger import assert_exactly_once, ledger_records, surviving_history  # noqa: E402
from support.runs import train_args  # noqa: E402
from train.ft import apply_means, weighted_sums  # noqa: E402

KILLED_AT = 3  # the step whose start, or whose all-reduce, kills group 1


@pytest.fixture
def lighthouse(tmp_path: Path) -> Iterator[str]:
    """A torchft lighthouse on a free port; a dead replica is noticed after 1 s."""
    port = free_port()
    with open(tmp_path / "lighthouse.log", "w") as out:
        proc = subprocess.Popen([shutil.which("torchft_lighthouse") or "torchft_lighthouse",
                                 "--min_replicas", "1", "--quorum_tick_ms", "100",
                                 "--join_timeout_ms", "2000", "--heartbeat_timeout_ms", "1000",
                                 "--bind", f"127.0.0.1:{port}"], stdout=out, stderr=out,
                                start_new_session=True)
    try:
        wait_for(lambda: port_open(port), "the lighthouse to listen", timeout=30, proc=proc)
        yield f"http://127.0.0.1:{port}"
    finally:
        died = proc.poll()
        proc.kill()
        proc.wait()
        assert died is None, f"the lighthouse died during the test (exit {died})"


def start_group(tiny_root: Path, run_root: Path, lighthouse: str, replica: int, fault: str,
                max_restarts: int = 0, groups: int = 2) -> subprocess.Popen:
    args = train_args(tiny_root, run_root, f"strategy.fault_tolerance.lighthouse={lighthouse}",
                      f"strategy.fault_tolerance.replica_id={replica}",
                      f"strategy.fault_tolerance.replica_groups={groups}",
                      "strategy.fault_tolerance.timeout_seconds=10",
                      "strategy.fault_tolerance.quorum_timeout_seconds=5",
                      "strategy.fault_tolerance.connect_timeout_seconds=5",
                      strategy="ddp_ft")
    return launch(torchrun(1, max_restarts=max_restarts), args, fault=fault,
                  log=run_root / f"group{replica}.log")


def ended(proc: subprocess.Popen, run_root: Path, replica: int) -> str:
    """Wait for group `replica`'s torchrun job; what it wrote to its log."""
    finish(proc, timeout=180)
    return (run_root / f"group{replica}.log").read_text()


def trainer_pid(run_root: Path, replica: int) -> Optional[int]:
    """The live trainer process of replica group `replica` (not its torchrun agent)."""
    for entry in Path("/proc").iterdir():
        try:
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if (f"run.root={run_root}".encode() in cmdline
                and f"replica_id={replica}\0".encode() in cmdline
                and b"torch.distributed.run" not in cmdline):
            return int(entry.name)
    return None


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
    lighthouse = subprocess.Popen(["torchft_lighthouse", "--min_replicas", "1",
                                   "--join_timeout_ms", "1000", "--bind", f"127.0.0.1:{port}"],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: port_open(port), "the lighthouse to listen", timeout=30)
        group = start_group(tiny_root, tmp_path, address, 0, "", groups=1)
        ledger = tmp_path / "ledger.jsonl"
        wait_for(lambda: (tmp_path / "r" / "checkpoints" / "replica_0").exists() and any(
            r["step"] >= 5 for r in ledger_records(ledger)), "a checkpoint", proc=group)
        lighthouse.kill()
        lighthouse.wait()
        out = ended(group, tmp_path, 0)
        assert group.returncode == 1, out[-3000:]
        assert f"error: no quorum from the torchft lighthouse at {address}" in out
        lighthouse = subprocess.Popen(["torchft_lighthouse", "--min_replicas", "1",
                                       "--join_timeout_ms", "1000",
                                       "--bind", f"127.0.0.1:{port}"],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_for(lambda: port_open(port), "the lighthouse to listen again", timeout=30)
        group = start_group(tiny_root, tmp_path, address, 0, "", groups=1)
        out = ended(group, tmp_path, 0)
        assert group.returncode == 0, out[-3000:]
    finally:
        lighthouse.kill()
        lighthouse.wait()
    assert "resume" in kinds(tmp_path, 0)
    assert_exactly_once(ledger)


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

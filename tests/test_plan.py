"""The checkpoint-interval planner: reference figures, the exact model against a Monte-Carlo
simulation of the same failures, and the command's output and refusals."""

import json
import math
import tracemalloc

import pytest

from checkpointing import plan
from common import jsonl
from support.streams import read_through_fifo

MIN, HOUR = 60.0, 3600.0
FOUR_YEARS = 4 * 8766 * HOUR


def test_reference_figures():
    assert plan.cluster_mtbf(16_384, FOUR_YEARS) / HOUR == pytest.approx(2.1, abs=0.05)
    C, M = 5 * MIN, 186 * MIN
    assert plan.young_interval(C, M) / MIN == pytest.approx(43.1, abs=0.05)
    assert plan.daly_interval(C, M) / MIN == pytest.approx(39.9, abs=0.05)
    t, R = 43 * MIN, 30 * MIN
    assert round(plan.first_order_goodput(t, C, R, M), 2) == 0.78
    assert round(plan.exact_goodput(t, C, R, M), 2) == 0.67


@pytest.mark.parametrize("C, M", [(5, 186), (0.1, 4 * HOUR), (60, 100), (1, 1e6)])
def test_the_exact_optimum_is_the_stationary_point(C, M):
    """d/dt of t / (e^((t+C)/M) - 1) vanishes where e^((t+C)/M) (1 - t/M) = 1."""
    t = plan.exact_optimum(C, M)
    assert math.exp((t + C) / M) * (1 - t / M) == pytest.approx(1, abs=1e-6)
    best = plan.exact_goodput(t, C, 1, M)
    assert best >= plan.exact_goodput(0.9 * t, C, 1, M)
    assert best >= plan.exact_goodput(1.1 * t, C, 1, M)


def test_daly_is_the_mtbf_when_a_save_takes_twice_as_long():
    assert plan.daly_interval(250, 100) == 100


@pytest.mark.parametrize("t, C, R, M", [(43, 5, 30, 186), (10, 1, 0.5, 20), (100, 20, 50, 60),
                                        (2, 0.1, 5, 1000)])
def test_the_simulation_agrees_with_the_exact_model(t, C, R, M):
    sim = plan.simulate(t, C, R, M, seed=1)
    assert sim.low <= plan.exact_goodput(t, C, R, M) <= sim.high
    assert sim.high - sim.low < 0.03  # narrow enough to tell the models apart:


def test_the_simulation_refutes_the_first_order_formula():
    sim = plan.simulate(43, 5, 30, 186, seed=1)
    assert not sim.low <= plan.first_order_goodput(43, 5, 30, 186) <= sim.high


def test_the_command_prints_the_three_intervals_side_by_side(capsys):
    code = plan.main(["--gpus", "16384", "--gpu-mtbf-hours", "35064", "--stall-seconds", "300",
                      "--restart-seconds", "1800", "--async-stall-seconds", "20",
                      "--step-seconds", "2"])
    out = capsys.readouterr().out
    assert code == 0
    assert "MTBF M = 2.14 h" in out
    rows = [line for line in out.splitlines() if line.startswith(("sync", "async"))]
    assert len(rows) == 6
    assert [r.split()[0] for r in rows] == ["sync"] * 3 + ["async"] * 3
    assert sum("exact optimum" in r for r in rows) == 2


def test_async_intervals_are_no_shorter_than_the_save():
    rows = plan.plan(plan.Measures(stall=600, restart=60, mtbf=HOUR, async_stall=0.01))
    async_rows = [r for r in rows if r.mode == "async"]
    assert all(r.interval == 600 and r.floored for r in async_rows)
    assert not any(r.floored for r in rows if r.mode == "sync")


@pytest.mark.parametrize("args, says", [
    (["--stall-seconds", "-1", "--restart-seconds", "3", "--mtbf-hours", "1"], "--stall-seconds"),
    (["--stall-seconds", "5", "--restart-seconds", "0", "--mtbf-hours", "1"], "--restart-seconds"),
    (["--stall-seconds", "5", "--restart-seconds", "3", "--mtbf-hours", "nan"], "--mtbf-hours"),
    (["--stall-seconds", "5", "--restart-seconds", "3", "--gpus", "0", "--gpu-mtbf-hours", "9"],
     "--gpus"),
    (["--stall-seconds", "5", "--restart-seconds", "3", "--gpus", "8"], "--gpu-mtbf-hours"),
    (["--stall-seconds", "7200", "--restart-seconds", "3", "--mtbf-hours", "1"], "twice the MTBF"),
    (["--restart-seconds", "3", "--mtbf-hours", "1"], "--stall-seconds"),
    (["--from-run", "/no/such/run", "--mtbf-hours", "1"], "not a directory"),
])
def test_bad_input_is_one_line_and_exit_2(capsys, args, says):
    assert plan.main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and says in err and err.count("\n") == 1


def test_from_run_reads_the_measured_stall_save_and_restart(tmp_path, capsys):
    """From events.jsonl as train/records/events.py writes it: rank 0's saves, and a resumed
    process's start-up and load; torn and foreign lines are skipped."""
    events = [{"kind": "start", "time": 100.0, "rank": 0, "pid": 7}]
    for step in (10, 20, 30):
        for rank in (0, 1):  # rank 0's count (older runs recorded every rank's)
            events += [{"kind": "save_staged", "rank": rank, "step": step, "stall": 0.5 + rank},
                       {"kind": "save_committed", "rank": rank, "step": step,
                        "seconds": 4.0 + rank}]
    events += [{"kind": "start", "time": 500.0, "rank": 0, "pid": 8},
               {"kind": "resume", "time": 512.0, "rank": 0, "pid": 8, "step": 20,
                "seconds": 2.0},
               {"kind": "resume", "rank": 0, "pid": 9, "step": 20, "seconds": "x"}]
    lines = [json.dumps(e) for e in events] + ["not json", "[1]", '{"kind": "save_sta']
    (tmp_path / "events.jsonl").write_text("\n".join(lines))
    (tmp_path / "goodput.json").write_text(json.dumps(
        {"seconds": {"compute": 9.0, "data_wait": 1.0, "checkpoint_stall": 0.0, "restore": 0.0,
                     "lost": 0.0}, "counted_steps": 100}))
    assert plan.main(["--from-run", str(tmp_path), "--mtbf-hours", "1"]) == 0
    out = capsys.readouterr().out
    assert "save 4 s, stall 0.5 s, restart 12 s" in out and "(3 saves, 1 resumes)" in out
    assert "restart R = 12 s, step 0.1 s" in out
    young_sync = next(line for line in out.splitlines() if line.startswith("sync"))
    assert f"{math.ceil(math.sqrt(2 * 4 * HOUR) / 0.1):,}" in young_sync


def test_from_run_reads_the_events_as_they_come(tmp_path):
    lines = [json.dumps(e) for e in SAVES] + ["torn {"]
    records, streamed = read_through_fifo(tmp_path / "events.jsonl", lines,
                                          lambda path: jsonl.records(path, parse_int=float))
    assert streamed and [r["kind"] for r in records] == [e["kind"] for e in SAVES]


def test_from_run_without_saves_says_what_is_missing(tmp_path, capsys):
    (tmp_path / "events.jsonl").write_text('{"kind": "start", "rank": 0}\n')
    assert plan.main(["--from-run", str(tmp_path), "--mtbf-hours", "1"]) == 2
    assert "no committed checkpoint save" in capsys.readouterr().err


def test_from_run_never_resumed_takes_the_start_up_as_the_restart(tmp_path, capsys):
    events = [{"kind": "start", "time": 100.0, "rank": 0, "pid": 7},
              {"kind": "first_step", "time": 109.0, "rank": 0, "pid": 7, "step": 1},
              {"kind": "save_staged", "rank": 0, "step": 2, "stall": 0.1},
              {"kind": "save_committed", "rank": 0, "step": 2, "seconds": 1.0}]
    (tmp_path / "events.jsonl").write_text("\n".join(json.dumps(e) for e in events))
    assert plan.main(["--from-run", str(tmp_path), "--mtbf-hours", "1"]) == 0
    out = capsys.readouterr().out
    assert "(1 saves, 1 starts, no resume)" in out and "restart R = 9 s" in out


BASE = {"--stall-seconds": "5", "--restart-seconds": "3", "--mtbf-hours": "1"}


@pytest.mark.parametrize("name", ["--stall-seconds", "--restart-seconds", "--mtbf-hours",
                                  "--async-stall-seconds", "--step-seconds"])
@pytest.mark.parametrize("value", ["1e308", "1e-308", "inf", "-5", "nan", "1e13"])
def test_numbers_out_of_range_are_one_line_and_exit_2(capsys, name, value):
    args = [a for k, v in {**BASE, name: value}.items() for a in (k, v)]
    assert plan.main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {name}=") and "from 1e-09 to 1e+12" in err
    assert err.count("\n") == 1


@pytest.mark.parametrize("gpus", ["0", "-3", "1" + "0" * 400])
def test_a_gpu_count_out_of_range_is_one_line(capsys, gpus):
    assert plan.main(["--gpus", gpus, "--gpu-mtbf-hours", "1", "--stall-seconds", "5",
                      "--restart-seconds", "3"]) == 2
    assert capsys.readouterr().err.startswith("error: --gpus=")


@pytest.mark.parametrize("args", [
    ["--mtbf-hours", "1e-9", "--stall-seconds", "1e-9", "--restart-seconds", "1e12"],
    ["--mtbf-hours", "1", "--stall-seconds", "5", "--restart-seconds", "3",
     "--async-stall-seconds", "1e12", "--step-seconds", "1e-9"],
    ["--gpus", "1000", "--gpu-mtbf-hours", "1e-6", "--stall-seconds", "1e-9",
     "--restart-seconds", "1e12"],
])
def test_extremes_in_range_plan_a_goodput_of_zero_not_a_crash(capsys, args):
    # A restart or a save hundreds of MTBFs long: the exact model's e^(R/M) overflows.
    assert plan.main(args) == 0
    assert "0.0%" in capsys.readouterr().out
    # auto_interval calls these with the measured stall and checkpoint.mtbf_hours
    assert plan.exact_goodput(1.0, 1.0, 1e6, 1.0) == 0.0
    assert 0 < plan.exact_optimum(1e4, 1.0) <= 1.0


SAVES = [{"kind": "start", "time": 100.0, "rank": 0, "pid": 7},
         {"kind": "first_step", "time": 109.0, "rank": 0, "pid": 7, "step": 1},
         {"kind": "save_staged", "rank": 0, "step": 2, "stall": 0.5},
         {"kind": "save_committed", "rank": 0, "step": 2, "seconds": 4.0}]


def test_from_run_skips_a_huge_garbage_line_unread(tmp_path, capsys):
    """The planner read events.jsonl a whole line at a time: a line of gigabytes without a
    newline cost its size in memory. Now it is skipped, and the saves after it count."""
    with open(tmp_path / "events.jsonl", "w") as f:
        f.write("x" * (64 << 20) + "\n")
        f.writelines(json.dumps(e) + "\n" for e in SAVES)
    tracemalloc.start()
    try:
        assert plan.main(["--from-run", str(tmp_path), "--mtbf-hours", "1"]) == 0
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20 and "(1 saves" in capsys.readouterr().out


@pytest.mark.parametrize("hostile", [
    '{"kind": "save_staged", "rank": 0, "stall": 1' + "0" * 400 + "}",  # inf as an int
    '{"kind": "save_committed", "rank": 0, "seconds": -1' + "0" * 5000 + "}",  # over 4300 digits
    "[" * 100_000 + "]" * 100_000,  # deeper than the parser's stack
    '{"kind": "save_staged", "rank": 0, "stall": true}',
    '{"kind": "resume", "time": 1e308, "rank": 0, "pid": 7, "step": 1, "seconds": 1}',
    '{"kind": "start", "time": -1e308, "rank": 0, "pid": 8}',
], ids=["huge-int", "5000-digits", "deep", "bool", "time-1e308", "time--1e308"])
@pytest.mark.parametrize("books", ['{"seconds": {"compute": 1e308, "data_wait": 1e308}, '
                                   '"counted_steps": 1}',
                                   '{"seconds": {"compute": 1, "data_wait": 1}, '
                                   '"counted_steps": 1e400}',
                                   "[" * 100_000], ids=["busy-inf", "steps-inf", "deep"])
def test_from_run_reads_around_hostile_lines(tmp_path, capsys, hostile, books):
    lines = [json.dumps(e) for e in SAVES] + [hostile]
    (tmp_path / "events.jsonl").write_text("\n".join(lines) + "\n")
    (tmp_path / "goodput.json").write_text(books)
    hydra = tmp_path / ".hydra" / "latest"
    hydra.mkdir(parents=True)
    (hydra / "config.yaml").write_text("checkpoint:\n  mtbf_hours: .inf\n")
    assert plan.main(["--from-run", str(tmp_path)]) == 2  # the run's MTBF is no MTBF
    assert capsys.readouterr().err.startswith("error: no MTBF")
    assert plan.main(["--from-run", str(tmp_path), "--mtbf-hours", "1"]) == 0
    out = capsys.readouterr().out
    assert "save 4 s, stall 0.5 s" in out and ", step" not in out.splitlines()[1]


def test_from_run_takes_an_explicit_zero_as_given_and_refuses_it(tmp_path, capsys):
    (tmp_path / "events.jsonl").write_text("\n".join(json.dumps(e) for e in SAVES))
    assert plan.main(["--from-run", str(tmp_path), "--mtbf-hours", "1",
                      "--restart-seconds", "0"]) == 2
    assert "error: --restart-seconds=0.0" in capsys.readouterr().err

"""SLURM without torchrun: the host-list parser, SLURM's variables read as torchrun's, two
tasks started as srun starts them training one DDP run, and Hydra's submitit launcher."""

from __future__ import annotations

import pytest

from support.launch import PYTHON, finish, free_port, launch, run_train
from support.runs import FINAL, tiny_overrides, train_args
from train.errors import ConfigError
from train.cluster.slurm import MAX_HOSTS, expand_hostlist, first_host, torchrun_environment


@pytest.mark.parametrize("text, hosts", [
    ("node07", ["node07"]),
    ("node[01-03,07]", ["node01", "node02", "node03", "node07"]),
    ("gpu[8-10]", ["gpu8", "gpu9", "gpu10"]),  # the width is the first bound's
    ("a[1-2],b,c[5]", ["a1", "a2", "b", "c5"]),
    ("rack[1-2]-n[0-1]", ["rack1-n0", "rack1-n1", "rack2-n0", "rack2-n1"]),
    ("n[1-2]-ib.cluster", ["n1-ib.cluster", "n2-ib.cluster"]),
])
def test_host_lists_expand_as_slurm_writes_them(text, hosts):
    assert expand_hostlist(text) == hosts
    assert first_host(text) == hosts[0]


@pytest.mark.parametrize("text", ["", "  ", "node[", "node[]", "n[3-1]", "n[a-b]", "a]b",
                                  "a,,b", "n[1-2", "n[[1]]", "x y", "n;rm -rf", "n[1-2]]",
                                  "n[" + "9" * 5000 + "]", "n[1]" * 2000, "n" + "[1]" * 500,
                                  "n[１-３]", "n[٠١-٠٣]", "n[1-²]"])
def test_a_malformed_host_list_is_refused(text):
    with pytest.raises(ValueError):
        expand_hostlist(text)


def test_a_huge_range_is_refused_whole_but_its_first_host_is_cheap():
    with pytest.raises(ValueError, match="more than"):
        expand_hostlist(f"n[0-{MAX_HOSTS}]")
    assert first_host("n[000000001-999999999]") == "n000000001"


SRUN = {"SLURM_NTASKS": "4", "SLURM_PROCID": "3", "SLURM_LOCALID": "1", "SLURM_NODEID": "1",
        "SLURM_JOB_NODELIST": "node[07-08]", "SLURM_JOB_ID": "123456"}


def test_an_srun_task_reads_as_a_torchrun_rank():
    assert torchrun_environment(SRUN) == {
        "RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "GROUP_RANK": "1",
        "MASTER_ADDR": "node07", "MASTER_PORT": str(15000 + 123456 % 20000)}
    assert torchrun_environment({**SRUN, "MASTER_PORT": "29500"})["MASTER_PORT"] == "29500"


def test_the_master_is_the_first_host_of_the_step_not_of_the_job():
    """`srun -w node[3-4]` inside a 4-node allocation: node1 runs no task of this step."""
    step = {**SRUN, "SLURM_JOB_NODELIST": "node[1-4]", "SLURM_NODELIST": "node[1-4]",
            "SLURM_STEP_NODELIST": "node[3-4]"}
    assert torchrun_environment(step)["MASTER_ADDR"] == "node3"
    with pytest.raises(ConfigError, match="SLURM_STEP_NODELIST='node\\['"):
        torchrun_environment({**step, "SLURM_STEP_NODELIST": "node["})


@pytest.mark.parametrize("env", [
    {},  # no SLURM
    {**SRUN, "SLURM_NTASKS": "1", "SLURM_PROCID": "0"},  # one task: a single process
    {**SRUN, "RANK": "0", "WORLD_SIZE": "2"},  # srun torchrun ...: torchrun's own win
])
def test_nothing_to_translate(env):
    assert torchrun_environment(env) == {}


@pytest.mark.parametrize("change, named", [
    ({"SLURM_NTASKS": "lots"}, "SLURM_NTASKS"),
    ({"SLURM_NTASKS": "-2"}, "SLURM_NTASKS"),
    ({"SLURM_PROCID": ""}, "SLURM_PROCID"),
    ({"SLURM_PROCID": "4"}, "SLURM_PROCID=4 is not below"),
    ({"SLURM_LOCALID": "1e9"}, "SLURM_LOCALID"),
    ({"SLURM_NODEID": "9" * 40}, "SLURM_NODEID"),
    ({"SLURM_JOB_NODELIST": ""}, "SLURM_JOB_NODELIST"),
    ({"SLURM_JOB_NODELIST": "node[07-"}, "SLURM_JOB_NODELIST"),
    ({"SLURM_JOB_ID": "abc"}, "SLURM_JOB_ID"),
    ({"SLURM_NTASKS": "٢"}, "SLURM_NTASKS"),  # digits of other scripts
    ({"SLURM_PROCID": "１"}, "SLURM_PROCID"),
    ({"SLURM_JOB_NODELIST": "n[1]" * 2000}, "SLURM_JOB_NODELIST"),  # deeper than the stack
    ({"MASTER_PORT": "abc"}, "MASTER_PORT='abc' is not a whole number from 1 to 65535"),
    ({"MASTER_PORT": "99999"}, "MASTER_PORT"),
    ({"MASTER_PORT": "0"}, "MASTER_PORT"),
    ({"MASTER_PORT": "-1"}, "MASTER_PORT"),
    ({"MASTER_PORT": "29500x"}, "MASTER_PORT"),
    ({"MASTER_PORT": "２９５００"}, "MASTER_PORT"),
])
def test_a_hostile_slurm_environment_is_one_line_naming_the_variable(change, named):
    with pytest.raises(ConfigError, match=named) as caught:
        torchrun_environment({**SRUN, **change})
    assert "\n" not in str(caught.value)


def test_two_srun_tasks_train_one_ddp_run_without_torchrun(tiny_root, tmp_path):
    """What `srun --ntasks 2 python -m train ... strategy=ddp` starts: two processes with
    SLURM's variables and no torchrun's."""
    slurm = {"SLURM_NTASKS": "2", "SLURM_NODEID": "0", "SLURM_JOB_NODELIST": "localhost",
             "SLURM_JOB_ID": "77", "MASTER_PORT": str(free_port())}
    tasks = [launch(PYTHON, train_args(tiny_root, tmp_path), SLURM_PROCID=str(rank),
                    SLURM_LOCALID=str(rank), **slurm) for rank in (0, 1)]
    outputs = [finish(task, timeout=240) for task in tasks]
    assert [t.returncode for t in tasks] == [0, 0], outputs[0][-3000:] + outputs[1][-3000:]
    assert (tmp_path / "r" / "checkpoints" / FINAL).is_dir()
    assert (tmp_path / "r" / "train_rank1.log").exists()  # rank 1 knew it was rank 1
    assert "rank 1 of 2" in (tmp_path / "r" / "train_rank1.log").read_text()


def test_the_submitit_local_launcher_trains_and_checkpoints(tiny_root, tmp_path):
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher", reason="pip install '.[sweep]'")
    result = run_train(["-m", "hydra/launcher=submitit_local", "+experiment=resnet",
                        *tiny_overrides(tiny_root), "trainer.max_epochs=1", "model=tiny_cnn",
                        "trainer.device=cpu", "logger=none", f"run.root={tmp_path}",
                        "run.name=job", "checkpoint.interval_steps=3"],
                       cwd=tmp_path, timeout=240)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    steps = sorted(p.name for p in (tmp_path / "job" / "checkpoints").glob("step_*"))
    assert steps == ["step_000000003", "step_000000006"], steps
    assert list((tmp_path / ".submitit").rglob("*_result.pkl"))  # submitit ran the job


def test_a_malformed_master_port_under_srun_is_one_line_and_exit_2(tiny_root, tmp_path):
    """Exit 2, not 1: torchrun and requeue loops retry a 1, and this cannot get better."""
    task = launch(PYTHON, train_args(tiny_root, tmp_path), stderr_apart=True,
                  **{**SRUN, "SLURM_PROCID": "0", "MASTER_PORT": "99999"})
    _, err = task.communicate(timeout=120)
    assert task.returncode == 2, err[-3000:]
    assert err.splitlines() == [
        "error: MASTER_PORT='99999' is not a whole number from 1 to 65535: set it to a free "
        "TCP port, or unset it for one derived from the job id"], err

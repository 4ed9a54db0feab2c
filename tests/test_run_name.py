"""Run identity: the same command lands in the same run, sweep jobs never share one."""

import re

import pytest

from support.launch import run_train
from support.runs import compose_config, tiny_overrides
from train.resume.checkpoint import RunCheckpoints, build_manager, training_config
from train.config import DEFAULT_RUN_NAME_EXCLUDES, default_run_name
from train.cluster.rank_dirs import run_paths
from train.cluster.world import World
from train.errors import ConfigError
from train.resume.stateful import DataIdentity, Position, RunInfo


def name(overrides, multirun=False, experiment="resnet", swept=()):
    return default_run_name(experiment, overrides, DEFAULT_RUN_NAME_EXCLUDES, multirun, swept)


def test_the_experiment_alone_names_a_plain_run():
    assert name(["+experiment=resnet"]) == "resnet"
    assert name([], experiment=None) == "default"


def test_keys_that_do_not_change_training_are_left_out():
    plain = name(["+experiment=resnet", "optim.lr=0.2"])
    assert plain == "resnet-optim.lr=0.2"
    assert name(["+experiment=resnet", "optim.lr=0.2", "trainer.max_steps=9",
                 "data.num_workers=4", "logger=none", "logger.tracking_uri=x",
                 "run.root=/tmp/x", "hydra.verbose=true"]) == plain


def test_override_order_does_not_matter_and_paths_stay_one_directory():
    a = name(["optim.lr=0.2", "data.root=/mnt/a/b", "seed=3"])
    assert a == name(["seed=3", "data.root=/mnt/a/b", "optim.lr=0.2"])
    assert "/" not in a


def test_a_key_given_twice_counts_once_with_its_last_value():
    """Hydra applies the last of repeated overrides: the name records that one alone."""
    assert name(["optim.lr=0.2", "seed=3", "optim.lr=0.5"]) == name(["seed=3", "optim.lr=0.5"])
    assert name(["seed=3", "+seed=4"]) == name(["seed=4"])


def test_multirun_jobs_keep_every_swept_key():
    # A sweep over an otherwise ignored key must not put two jobs in one directory.
    jobs = {name(["trainer.max_steps=5", f"data.num_workers={w}"], multirun=True)
            for w in (0, 2)}
    assert len(jobs) == 2


def test_long_names_are_shortened_but_stay_distinct():
    a = name([f"data.root=/{'x' * 200}"])
    b = name([f"data.root=/{'y' * 200}"])
    assert len(a) <= 120 and len(b) <= 120 and a != b


FIXED = ["data.image_size=32", "checkpoint.interval_steps=2", "trainer.max_epochs=1",
         "data.global_batch_size=20", "data.val_batch_size=30", "scheduler.warmup_steps=2",
         "model=tiny_cnn", "logger.log_model=false", "trainer.device=cpu"]


def test_a_sweep_job_s_name_leads_with_what_the_sweep_varies_and_stays_bounded():
    """It was the overrides in key order cut at 100 characters plus a hash: the swept value
    fell past the cut, invisible in the directory, the run list and MLflow's run names."""
    lrs = ["0.001", "0.0012345678901234", "0.002"]
    names = [name([*FIXED, f"optim.lr={lr}", "optim.weight_decay=0.05"], True,
                  swept=["optim.weight_decay", "optim.lr"]) for lr in lrs]
    full = sorted(name([*FIXED, "optim.lr=0.001"], True)[len("resnet-"):].split(","))
    for job, lr in zip(names, lrs):
        assert job.startswith(f"resnet-optim.lr={lr},optim.weight_decay=0.05,"), job
        assert len(job) <= 120 and re.fullmatch(r".*-[0-9a-f]{10}", job), job
        shown = job[len("resnet-"):].rsplit("-", 1)[0].split(",")
        assert all(part in full or part.startswith("optim.") for part in shown)  # whole
    assert len(set(names)) == len(names)
    # the same job whatever the order typed: one run; the swept keys only order the parts
    assert names[0] == name(["optim.weight_decay=0.05", "optim.lr=0.001", *FIXED[::-1]], True,
                            swept=["optim.lr", "optim.weight_decay"])
    short = name(["optim.lr=0.1", "seed=3"], True, swept=["seed"])
    assert short == "resnet-seed=3,optim.lr=0.1"
    assert name(["optim.lr=0.1", "seed=3"], True) == "resnet-optim.lr=0.1,seed=3"
    assert "s3cret" not in name(["data.root=http://u:s3cret@h/v", "seed=1"], True,
                                swept=["data.root"])


LOCATIONS = ["checkpoint.dir=/x/ck", "checkpoint.staging_dir=/nvme/stage",
             "data.cache_dir=/nvme/cache", "run.root=/x/runs", "audit.ledger=/x/l.jsonl",
             "logger.tracking_uri=http://u:pw@mlflow:5000", "hydra.run.dir=/x/y"]


@pytest.mark.parametrize("multirun", [False, True])
def test_where_files_go_is_never_part_of_a_name_not_even_in_a_sweep(multirun):
    assert name(["+experiment=resnet", "optim.lr=0.2", *LOCATIONS], multirun) == (
        "resnet-optim.lr=0.2")


@pytest.mark.parametrize("key", ["data.root", "model.name", "checkpoint.interval_steps"])
def test_credentials_never_reach_a_name(key):
    for value in ["http://alice:s3cret@host/vol", "s3://bucket/vol?X-Amz-Signature=s3cret",
                  "https://host/vol?sig=s3cret&x=1", "webdav://s3cret@host/d/"]:
        for multirun in (False, True):
            assert "s3cret" not in name([f"{key}={value}"], multirun)


def test_a_long_path_is_shortened_to_its_last_component_and_a_hash():
    a = name(["data.root=/tmp/pytest-of-root/pytest-12/test_sweep0/vol", "optim.lr=0.1"])
    assert re.fullmatch(r"resnet-data\.root=vol~[0-9a-f]{8},optim\.lr=0\.1", a)
    assert a != name(["data.root=/tmp/pytest-of-root/pytest-13/test_sweep0/vol",
                      "optim.lr=0.1"])
    assert name(["data.root=https://u:p@host/data/imagenet/?token=t"]).startswith(
        "resnet-data.root=imagenet~")


def test_names_are_plain_directory_names_and_distinct_for_distinct_overrides():
    values = ["0.1", "a b", "a_b", "a/b", "b", "..", ".", "", "x" * 32, "x" * 33, "*", "$HOME",
              "a,b", "a=b", "é", "line\nbreak", "vol~0123abcd", "'q'", "[1,2]", "-5", "a\x00b"]
    overrides = [[f"model.name={v}"] for v in values] + [
        ["model.name=a", "optim.lr=b"], ["model.name=a,optim.lr=b"], ["~model.name"],
        [f"data.root=/{'x' * 200}"], [f"data.root=/{'x' * 199}"]]
    names = [name(o) for o in overrides]
    for n in names:
        assert re.fullmatch(r"[A-Za-z0-9._+~,=-]{1,120}", n) and n not in (".", ".."), n
    assert len(set(names)) == len(names)


class RunInfoBeforeNames(RunInfo):
    """A checkpoint header as saved before run names were recorded."""

    def state_dict(self) -> dict:
        return {k: v for k, v in super().state_dict().items() if k != "run_name"}


def checkpoints_of(tmp_path, run_name, *overrides, save_with=RunInfo):
    """Run `run_name`'s checkpoints over the shared checkpoint.dir, holding only its header
    (a `save_with` built as train.app builds it)."""
    cfg = compose_config(["+experiment=resnet", f"run.name='{run_name}'", "logger=none",
                          f"checkpoint.dir={tmp_path / 'ck'}", "checkpoint.async_mode=off",
                          *overrides])
    world = World(rank=0, world_size=1, local_rank=0, control_group=None)
    info = save_with(mlflow_run_id=f"mlflow-{run_name}", run_name=cfg.run.name,
                     config=training_config(cfg))
    return info, RunCheckpoints(cfg, build_manager(cfg, run_paths(cfg, None, None), world), {"run": info},
                                DataIdentity(0, 1, 1), world_size=1)


def resume_as(tmp_path, run_name, *overrides, save_with=None):
    """A restore of run `run_name` over the shared checkpoint.dir; with `save_with` (a
    RunInfo class), then a save at its next step, as a run does. Returns the MLflow run id
    restored (None: a fresh start) and the step reached."""
    _, checkpoints = checkpoints_of(tmp_path, run_name, *overrides,
                                    save_with=save_with or RunInfo)
    try:
        restored = checkpoints.restore()
        position = restored.position if restored else Position()
        if save_with:
            position = position.advanced(steps_per_epoch=1)
            checkpoints.save(position, last_step=True)
        return (restored.run.mlflow_run_id if restored else None), position.step
    finally:
        checkpoints.close()


def test_another_runs_checkpoint_is_never_resumed(tmp_path):
    assert resume_as(tmp_path, "resnet-optim.lr=0.1", save_with=RunInfo) == (None, 1)
    with pytest.raises(ConfigError, match=re.escape(
            "holds checkpoints of another run ('resnet-optim.lr=0.1'), not of this run "
            "(resnet-optim.lr=0.05): give every run a checkpoint.dir of its own, e.g. "
            "checkpoint.dir=/some/dir/${run.name}")):
        resume_as(tmp_path, "resnet-optim.lr=0.05")
    assert resume_as(tmp_path, "resnet-optim.lr=0.1") == ("mlflow-resnet-optim.lr=0.1", 1)


def test_a_checkpoint_saved_before_names_were_recorded_resumes_by_its_identity_keys(tmp_path):
    resume_as(tmp_path, "old", save_with=RunInfoBeforeNames)
    assert resume_as(tmp_path, "renamed", save_with=RunInfo) == ("mlflow-old", 2)
    with pytest.raises(ConfigError, match="holds checkpoints of another run"):
        resume_as(tmp_path, "old")  # the new checkpoint records its run's name
    resume_as(tmp_path / "other", "old", save_with=RunInfoBeforeNames)
    with pytest.raises(ConfigError, match="model.name changed since the checkpoint"):
        resume_as(tmp_path / "other", "old", "model=tiny_cnn")


def test_a_sweep_sharing_one_checkpoint_dir_stops_at_the_second_job(tiny_root, tmp_path):
    result = run_train(["-m", *tiny_overrides(tiny_root), "model=tiny_cnn", "logger=none",
                        "trainer.device=cpu", "trainer.max_steps=2", f"run.root={tmp_path}",
                        f"checkpoint.dir={tmp_path / 'ck'}", "optim.lr=0.1,0.05"], cwd=tmp_path)
    assert result.returncode == 2, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "holds checkpoints of another run" in errors[0]
    assert "already complete" not in result.stdout + result.stderr
    jobs = [p.name for p in tmp_path.iterdir() if p.name.startswith("default-")]
    assert len(jobs) == 2  # a run directory each, named without the paths typed
    assert not any("checkpoint" in job or tmp_path.name in job for job in jobs)


def test_where_a_run_goes_is_never_what_it_trains_whatever_exclude_keys_says():
    """The run's name, the ft groups' identity check and the checkpoint's record of the
    config leave out the same keys: with run.exclude_keys emptied, the training config held
    the node-local cache directory and the tracking store, so two replica groups on
    different nodes were refused as training different things."""
    cfg = compose_config(["+experiment=resnet", "run.exclude_keys=[]",
                          "logger.tracking_uri=http://u:s3cret@127.0.0.1:9"])
    kept = training_config(cfg)
    assert "model.name" in kept and "trainer.max_steps" in kept  # excludes are emptied
    assert not [k for k in kept if k.split(".")[0] in ("run", "checkpoint", "audit")
                or k.startswith(("data.cache_dir", "logger.tracking_uri"))], sorted(kept)


def test_a_rollback_leaves_this_runs_header_alone(tmp_path):
    """A load hands back the saved run's header and never writes the live one: a rollback,
    after resuming with a changed key, to a checkpoint saved before, used to make every
    later save record that checkpoint's config and MLflow run as this run's."""
    resume_as(tmp_path, "r", save_with=RunInfo)  # step 1, optim.lr as the experiment has it
    info, checkpoints = checkpoints_of(tmp_path, "r", "optim.lr=0.5")
    try:
        assert checkpoints.restore().position.step == 1
        info.mlflow_run_id = "mlflow-now"  # what the tracker then gave this process
        live = dict(info.config)
        assert checkpoints.roll_back().position.step == 1
        assert (info.config, info.mlflow_run_id) == (live, "mlflow-now")
        assert info.config["optim.lr"] == "0.5"
    finally:
        checkpoints.close()

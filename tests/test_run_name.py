"""Run identity: the same command lands in the same run, sweep jobs never share one."""

from train.config import DEFAULT_RUN_NAME_EXCLUDES, default_run_name


def name(overrides, multirun=False, experiment="resnet"):
    return default_run_name(experiment, overrides, DEFAULT_RUN_NAME_EXCLUDES, multirun)


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


def test_multirun_jobs_keep_every_swept_key():
    # A sweep over an otherwise ignored key must not put two jobs in one directory.
    jobs = {name(["trainer.max_steps=5", f"data.num_workers={w}"], multirun=True)
            for w in (0, 2)}
    assert len(jobs) == 2


def test_long_names_are_shortened_but_stay_distinct():
    a = name([f"data.root=/{'x' * 200}"])
    b = name([f"data.root=/{'y' * 200}"])
    assert len(a) <= 120 and len(b) <= 120 and a != b

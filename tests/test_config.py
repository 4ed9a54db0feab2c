"""Every config composes, every experiment builds, overrides reach the code, typos fail."""

from __future__ import annotations

import copy
import dataclasses
import math
import re
from typing import List, Optional, get_type_hints

import pytest
import torch
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from checkpointing.manager import CheckpointOptions
from checkpointing.options import AsyncMode, CheckpointFormat
from data.pipeline import build_datasets, build_loader
from data.sampler import BatchPlan, GlobalBatchSampler
from support.launch import run_train
from support.runs import CONF, compose_config, tiny_overrides
from train.config import Bounds, Config, validate
from train.errors import ConfigError
from train.learn.model import build_model
from train.learn.optim import build_optimizer, build_scheduler

GROUPS = sorted(p.name for p in CONF.iterdir() if p.is_dir())
EXPERIMENTS = sorted(p.stem for p in (CONF / "experiment").glob("*.yaml"))


def group_options():
    for group in GROUPS:
        for option in sorted((CONF / group).glob("*.yaml")):
            appended = group in ("experiment", "hparams_search")
            yield f"{'+' if appended else ''}{group}={option.stem}"


def test_the_config_tree_has_every_group_the_architecture_names():
    for group in ["model", "data", "strategy", "optim", "scheduler", "trainer", "logger",
                  "experiment", "hparams_search"]:
        assert group in GROUPS, group
    assert "resnet" in EXPERIMENTS


@pytest.mark.parametrize("override", list(group_options()))
def test_every_config_composes(override):
    cfg = compose_config([override])
    OmegaConf.to_container(cfg.data, resolve=True)  # interpolations resolve
    assert cfg.model.name and cfg.optim.lr > 0


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_every_experiment_builds_its_model_and_data(experiment, tiny_root, tmp_path):
    cfg = compose_config([f"+experiment={experiment}", *tiny_overrides(tiny_root),
                          f"data.cache_dir={tmp_path / 'cache'}"])
    train_set, _ = build_datasets(cfg.data, cfg.seed, cfg.data.cache_dir)
    plan = BatchPlan(len(train_set), cfg.data.global_batch_size)
    loader = build_loader(train_set, GlobalBatchSampler(plan, cfg.seed), cfg.data, False)
    batch = next(iter(loader))
    size = cfg.data.image_size
    assert batch.images.shape == (plan.micro_batch_size, 3, size, size)
    assert batch.images.dtype == torch.uint8
    model = build_model(cfg.model, train_set.num_classes)
    assert model(batch.images.float()).shape == (plan.micro_batch_size, train_set.num_classes)


def test_overrides_reach_the_optimizer_and_scheduler():
    cfg = compose_config(["+experiment=resnet", "optim=adamw", "optim.lr=0.0123",
                          "optim.weight_decay=0.07", "scheduler.warmup_steps=4"])
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    optimizer = build_optimizer(cfg.optim, model)
    assert isinstance(optimizer, torch.optim.AdamW)
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.07, 0.0]
    scheduler = build_scheduler(cfg.scheduler, optimizer, total_steps=100, steps_per_epoch=10)
    # Warmup: step 0 runs at lr/4, and the peak is the configured lr.
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.0123 / 4)
    for _ in range(3):
        optimizer.step()
        scheduler.step()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.0123)


@pytest.mark.parametrize("override, message", [
    ("optim.lrr=0.1", "lrr"),
    ("trainer.device=gpu", "gpu"),
    ("optim=adam", "adam"),
])
def test_a_wrong_key_or_value_is_rejected_at_compose(override, message):
    with pytest.raises(ConfigCompositionException, match=message):
        compose_config(["+experiment=resnet", override])


@pytest.mark.parametrize("override, message", [
    ("optim.lrr=0.1", "Key 'lrr' not in 'OptimConfig'"),
    ("optim.lr=abc", "Value 'abc' of type 'str' could not be converted to Float"),
    ("+experiment=resnett", "Could not find 'experiment/resnett'"),
])
def test_a_mistake_hydra_finds_exits_2_without_a_traceback(tmp_path, override, message):
    """Exit code 2, not 1: torchrun --max-restarts would run a typo again and again."""
    result = run_train([override], cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    assert not (tmp_path / "outputs").exists()  # failed before any work


@pytest.mark.parametrize("args", [["--help"], ["--cfg", "job"]])
def test_help_and_printing_the_config_still_exit_0(tmp_path, args):
    result = run_train(["+experiment=resnet", *args], cwd=tmp_path)
    assert result.returncode == 0, result.stderr


def schema_fields(schema=Config, prefix=""):
    """(key, dataclass field, its type) of every leaf of the schema."""
    types = get_type_hints(schema)
    for spec in dataclasses.fields(schema):
        if dataclasses.is_dataclass(types[spec.name]):
            yield from schema_fields(types[spec.name], f"{prefix}{spec.name}.")
        else:
            yield f"{prefix}{spec.name}", spec, types[spec.name]


def test_every_numeric_key_has_bounds():
    numeric = {int, float, Optional[int], Optional[float], List[int], List[float]}
    keys = [key for key, spec, kind in schema_fields() if kind in numeric]
    assert len(keys) > 40
    assert [key for key, spec, kind in schema_fields()
            if kind in numeric and "bounds" not in spec.metadata] == []


def just_outside(bounds: Bounds, integer: bool) -> list:
    step = 1 if integer else 1e-6
    return ([bounds.ge - step] if bounds.ge is not None else []) + (
        [bounds.gt] if bounds.gt is not None else []) + (
        [bounds.le + (step if integer else max(step, abs(bounds.le) * 1e-9))]
        if bounds.le is not None else []) + (
        [bounds.lt] if bounds.lt is not None else [])


def test_every_numeric_key_refuses_values_outside_its_bounds_and_non_finite_floats():
    cfg = compose_config(["+experiment=resnet"])
    validate(cfg)  # the composed config (schema defaults, then the YAMLs) is in range
    cases = 0
    for key, spec, kind in schema_fields():
        if "bounds" not in spec.metadata:
            continue
        bounds = spec.metadata["bounds"]
        integer = int in (kind, *getattr(kind, "__args__", ()))
        bad = just_outside(bounds, integer) + ([] if integer else [math.nan, math.inf, -math.inf])
        limits = [limit for limit in (bounds.ge, bounds.le) if limit is not None]
        for value, allowed in [*((v, False) for v in bad), *((v, True) for v in limits)]:
            changed = copy.deepcopy(cfg)
            OmegaConf.update(changed, key, [value] if kind == List[float] else value)
            shown = OmegaConf.select(changed, key)
            if allowed:
                validate(changed)
            else:
                with pytest.raises(ConfigError, match=re.escape(
                        f"{key}={shown} is out of range: it must be ")):
                    validate(changed)
            cases += 1
    assert cases > 80


def test_every_schema_default_is_in_range():
    """The schema's own defaults, not the composed config: a YAML that sets a key hides
    its default from `validate`, until the YAML stops setting it."""
    wrong = []
    for key, spec, kind in schema_fields():
        if "bounds" not in spec.metadata:
            continue
        default = (spec.default if spec.default is not dataclasses.MISSING
                   else spec.default_factory())
        values = default if isinstance(default, list) else [default]
        if not all(v is None or spec.metadata["bounds"].allows(v) for v in values):
            wrong.append(f"{key}={default}")
    assert wrong == []


@pytest.mark.parametrize("override", list(group_options()))
def test_every_config_option_is_in_range(override):
    validate(compose_config([override]))


def test_an_out_of_range_value_is_one_line_and_exit_2_before_any_work(tmp_path):
    result = run_train(["+experiment=resnet", "checkpoint.interval_steps=0",
                        "logger=none", "trainer.device=cpu"], cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        "error: checkpoint.interval_steps=0 is out of range: it must be >= 1")
    assert "Traceback" not in result.stderr + result.stdout
    assert not list(tmp_path.rglob("datasets"))  # no data generated or read


def test_checkpoint_options_the_manager_refuses_are_refused_at_config_validation():
    """keep_last=1 passed the schema and was refused by the manager only after the datasets
    were built; the async modes and formats were an enum here and a tuple there."""
    with pytest.raises(ConfigError, match=re.escape(
            "checkpoint.keep_last=1 is out of range: it must be >= 2")):
        validate(compose_config(["+experiment=resnet", "checkpoint.keep_last=1"]))
    for mode in AsyncMode:
        CheckpointOptions(dir="x", async_mode=mode.value)
    for form in CheckpointFormat:
        CheckpointOptions(dir="x", format=form.value)


def test_every_local_directory_key_refuses_a_url():
    """A cache or staging tier is a disk on this node: a URL there would become a relative
    directory named after the URL, credentials and all."""
    keys = [key for key, spec, _ in schema_fields() if spec.metadata.get("local_dir")]
    assert {"data.cache_dir", "checkpoint.staging_dir"} <= set(keys)
    cfg = compose_config(["+experiment=resnet"])
    for key in keys:
        for url in ("http://u:s3cret@127.0.0.1:9/c", "s3://bucket/cache", "file:///tmp/x"):
            changed = copy.deepcopy(cfg)
            OmegaConf.update(changed, key, url)
            with pytest.raises(ConfigError, match=f"^{re.escape(key)}=.* is a URL") as err:
                validate(changed)
            assert "s3cret" not in str(err.value)
        for path in ("/tmp/cache", "relative/cache", None):
            changed = copy.deepcopy(cfg)
            OmegaConf.update(changed, key, path)
            validate(changed)


@pytest.mark.parametrize("empty", ["", " ", "\t"])
def test_every_directory_key_refuses_an_empty_path(empty):
    """Path("") is the working directory: an empty data.cache_dir filled the directory the
    run started in (a checkout) with objects/, locks/, index/ and the ledger; an empty
    run.root or checkpoint.dir put the run there."""
    keys = [key for key, spec, _ in schema_fields()
            if spec.metadata.get("local_dir") or spec.metadata.get("place")]
    assert {"run.root", "checkpoint.dir", "data.root", "data.cache_dir"} <= set(keys)
    cfg = compose_config(["+experiment=resnet"])
    for key in keys:
        changed = copy.deepcopy(cfg)
        OmegaConf.update(changed, key, empty)
        with pytest.raises(ConfigError, match=f"^{re.escape(key)}=.* is empty: "):
            validate(changed)


def test_a_url_as_cache_dir_is_one_line_and_exit_2_and_creates_nothing(tmp_path):
    result = run_train(["+experiment=resnet", "data.cache_dir=http://u:s3cret@127.0.0.1:9/c",
                        "logger=none", "trainer.device=cpu"], cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        "error: data.cache_dir=http://127.0.0.1:9/c is a URL: it must be a directory on "
        "this node's local disk (or null)")
    assert "Traceback" not in result.stderr + result.stdout
    assert not (tmp_path / "http:").exists() and not list(tmp_path.rglob("*s3cret*"))


def test_an_image_size_that_would_exhaust_memory_is_refused():
    """Every image is resized to `image_size` squared in a data worker: 100000 asks for
    30 GB per image and dies with a traceback, retried by torchrun."""
    cfg = compose_config(["+experiment=resnet", "data.image_size=100000"])
    with pytest.raises(ConfigError, match="data.image_size=100000 is out of range"):
        validate(cfg)


@pytest.mark.parametrize("name", ["", ".", "..", "../../escaped", "a/b", "/abs", "a\0b",
                                  pytest.param("x" * 300, id="long")])
def test_a_run_name_that_is_not_one_directory_is_refused(name):
    """The run writes into run.root/run.name: a name with a '/' or '..' lands outside
    run.root, an empty one or '.' in run.root itself, among other runs."""
    cfg = compose_config(["+experiment=resnet"])
    cfg.run.name = name
    with pytest.raises(ConfigError, match="run.name=.* it must be one plain directory name"):
        validate(cfg)
    cfg.run.name = "resnet-optim.lr=0.1"
    validate(cfg)


@pytest.mark.parametrize("key", [
    "strategy.timeout_seconds", "strategy.init_timeout_seconds",
    "strategy.fault_tolerance.quorum_timeout_seconds",
    "strategy.fault_tolerance.timeout_seconds",
    "strategy.fault_tolerance.connect_timeout_seconds", "health.hang_seconds",
    "checkpoint.commit_timeout_s", "checkpoint.mtbf_hours", "checkpoint.restart_seconds"])
@pytest.mark.parametrize("huge", [1e12 + 1, 1e300, 1.7e308])
def test_a_huge_timeout_or_failure_time_is_refused_at_start(key, huge):
    """Finite but absurd: a timeout of 1e300 s overflowed timedelta and torchft's client (a
    traceback, exit 1), a huge torchft connect timeout ignored SIGTERM, an mtbf_hours of
    1.7e308 is infinite in seconds and crashed checkpoint.auto_interval at the first save."""
    cfg = compose_config(["+experiment=resnet", "strategy=ddp_ft"])
    OmegaConf.update(cfg, key, huge)
    with pytest.raises(ConfigError, match=f"^{re.escape(key)}=.* is out of range: it must be "
                                          f".*<= "):
        validate(cfg)


@pytest.mark.parametrize("lighthouse", ["garbage", "", " ", "127.0.0.1:29510", "ftp://h:1",
                                        "http://", "http://h:1/path", "http://h:123456",
                                        "http://h:1\nx"])
def test_a_lighthouse_that_is_not_an_http_url_is_refused_at_start(lighthouse):
    """torchft's client took these and failed later as if the lighthouse were down (exit 1,
    retried), or named its own environment variable ('' -> 'TORCHFT_LIGHTHOUSE')."""
    cfg = compose_config(["+experiment=resnet", "strategy=ddp_ft"])
    cfg.strategy.fault_tolerance.lighthouse = lighthouse
    with pytest.raises(ConfigError, match="^strategy.fault_tolerance.lighthouse=.* is not an "
                                          "http URL: give the server as http://HOST:PORT$") as err:
        validate(cfg)
    assert "s3cret" not in str(err.value) and "\n" not in str(err.value)
    for good in ("http://127.0.0.1:29510", "https://lighthouse.example:443/", "http://[::1]:1",
                 "http://lh"):
        cfg.strategy.fault_tolerance.lighthouse = good
        validate(cfg)


@pytest.mark.parametrize("lighthouse", ["http://u:s3cret@h:1", "http://s3cret@h:1",
                                        "https://:s3cret@[::1]:1/", "http://u:s3cret@@h:1",
                                        "http://u:s3c/ret@h:1", "HTTP://s3cret@h"])
def test_a_lighthouse_url_with_credentials_says_so(lighthouse):
    """With its credentials stripped from the message the URL looked fine, and the message
    said it was "not an http URL"."""
    cfg = compose_config(["+experiment=resnet", "strategy=ddp_ft"])
    cfg.strategy.fault_tolerance.lighthouse = lighthouse
    with pytest.raises(ConfigError, match="^strategy.fault_tolerance.lighthouse=.* holds "
                                          "credentials .*: the server takes none; give it as "
                                          "http://HOST:PORT$") as err:
        validate(cfg)
    assert "s3cret" not in str(err.value) and "not an http URL" not in str(err.value)


@pytest.mark.parametrize("replica_id, groups", [(2, 2), (1, 1), (9, 8)])
def test_a_replica_id_outside_the_groups_is_refused(replica_id, groups):
    cfg = compose_config(["+experiment=resnet", "strategy=ddp_ft",
                          f"strategy.fault_tolerance.replica_id={replica_id}",
                          f"strategy.fault_tolerance.replica_groups={groups}"])
    with pytest.raises(ConfigError, match=(
            f"^strategy.fault_tolerance.replica_id={replica_id} is not one of the "
            f"replica_groups={groups} groups: give each group an id in 0..{groups - 1}, or "
            f"raise replica_groups$")):
        validate(cfg)
    cfg.strategy.name = "ddp"  # only ddp_ft has replica groups
    validate(cfg)
    cfg.strategy.name = "ddp_ft"
    cfg.strategy.fault_tolerance.replica_id = groups - 1
    validate(cfg)


def test_a_replica_id_outside_the_groups_is_one_line_and_exit_2(tmp_path):
    result = run_train(["+experiment=resnet", "strategy=ddp_ft", "logger=none",
                        "strategy.fault_tolerance.replica_id=2"], cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith(
        "error: strategy.fault_tolerance.replica_id=2 is not one of the replica_groups=2 ")
    assert "Traceback" not in result.stderr + result.stdout


@pytest.mark.parametrize("min_replicas, groups", [(3, 2), (2, 1), (100, 8)])
def test_ddp_ft_refuses_a_quorum_above_the_planned_width(min_replicas, groups):
    from train.recovery.replicas import check_fault_tolerance

    cfg = compose_config(["+experiment=resnet", "strategy=ddp_ft",
                          f"strategy.fault_tolerance.min_replicas={min_replicas}",
                          f"strategy.fault_tolerance.replica_groups={groups}"])
    with pytest.raises(ConfigError, match="min_replicas=.* is above replica_groups=.*: no step "
                                          "could commit"):
        check_fault_tolerance(1, cfg.strategy.fault_tolerance)
    cfg.strategy.fault_tolerance.min_replicas = groups
    check_fault_tolerance(1, cfg.strategy.fault_tolerance)

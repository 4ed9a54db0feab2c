"""Every config composes, every experiment builds, overrides reach the code, typos fail."""

from __future__ import annotations

import pytest
import torch
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from conftest import CONF, compose_config, run_train, tiny_overrides
from data.pipeline import build_datasets, build_loader
from data.sampler import BatchPlan, GlobalBatchSampler
from train.model import build_model
from train.optim import build_optimizer, build_scheduler

GROUPS = sorted(p.name for p in CONF.iterdir() if p.is_dir())
EXPERIMENTS = sorted(p.stem for p in (CONF / "experiment").glob("*.yaml"))


def group_options():
    for group in GROUPS:
        for option in sorted((CONF / group).glob("*.yaml")):
            appended = group in ("experiment", "hparams_search")
            yield f"{'+' if appended else ''}{group}={option.stem}"


def test_the_config_tree_has_every_group_design_md_names():
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
    train_set, _ = build_datasets(cfg.data, cfg.seed)
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


def test_a_misspelt_key_fails_on_the_command_line_without_a_traceback(tmp_path):
    result = run_train(["+experiment=resnet", "optim.lrr=0.1"], cwd=tmp_path)
    assert result.returncode != 0
    assert "Key 'lrr' not in 'OptimConfig'" in result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    assert not (tmp_path / "outputs").exists()  # failed before any work

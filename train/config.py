"""Typed configuration: the schema every YAML file in `conf/` is merged onto.

Hydra validates overrides against these dataclasses, so a misspelt key (`optim.lrr=0.1`) or
a bad value (`trainer.device=gpu`) fails at start with Hydra's own one-line message, before
any work is done.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, List, Optional

from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import OmegaConf

from data.errors import OnBadFile
from train.launch import register_resolvers as register_launch_resolvers


class Device(str, Enum):
    auto = "auto"
    cpu = "cpu"
    cuda = "cuda"


class Precision(str, Enum):
    auto = "auto"  # bf16 autocast on CUDA, fp32 on CPU
    fp32 = "fp32"
    bf16 = "bf16"


class OptimizerName(str, Enum):
    sgd = "sgd"
    adamw = "adamw"


class SchedulerName(str, Enum):
    cosine = "cosine"
    step = "step"
    constant = "constant"


class AsyncMode(str, Enum):
    off = "off"  # synchronous dcp.save
    thread = "thread"  # dcp.async_save in a background thread
    process = "process"  # dcp.async_save in a background process


class ResumeMode(str, Enum):
    auto = "auto"  # resume when a complete checkpoint exists
    required = "required"  # fail without one
    never = "never"  # refuse to start where checkpoints exist


class StrategyName(str, Enum):
    single = "single"  # one process
    ddp = "ddp"  # DistributedDataParallel: replicated parameters, averaged gradients
    fsdp = "fsdp"  # FSDP2 fully_shard: parameters, gradients and optimizer state sharded


class LoggerName(str, Enum):
    mlflow = "mlflow"
    none = "none"


# Overrides that change how a run is executed or observed but not what it trains: they are
# left out of the default run name so that, e.g., extending `trainer.max_steps` resumes the
# same run instead of starting a new one. Prefixes match whole key segments.
DEFAULT_RUN_NAME_EXCLUDES = [
    "trainer.max_steps",
    "trainer.device",
    "trainer.log_every_steps",
    "trainer.save_final_weights",
    "data.num_workers",
    "data.prefetch_factor",
    "data.cache_dir",
    "data.cache_limit_gb",
    "data.prefetch_threads",
    "data.prefetch_batches",
    "data.read_retries",
    "data.retry_backoff_seconds",
    "data.reindex",
    "strategy",  # how the same model trains over ranks, not what it trains
    "health.hang_seconds",
    "health.preflight",
    "audit",
    "checkpoint",
    "logger",
    "run",
    "hydra",
]


@dataclass
class RunConfig:
    # The run's identity: the same name lands in the same output directory (and resumes).
    name: str = "${goodput.run_name:}"
    root: str = "outputs"
    exclude_keys: List[str] = field(default_factory=lambda: list(DEFAULT_RUN_NAME_EXCLUDES))


@dataclass
class ModelConfig:
    # Any torchvision classification model: torchvision.models.list_models(torchvision.models)
    name: str = "resnet18"
    dropout: float = 0.0  # on the classifier's input (it draws from the global RNG)


@dataclass
class SyntheticConfig:
    """The embedded shapes dataset, generated on first use when `data.root` is `dir`."""

    num_train: int = 10000
    num_val: int = 2000
    size: int = 96  # image width in pixels; height is 3/4 of it (like ImageNet's 500x375)
    seed: int = 0
    dir: str = "datasets/shapes-seed${.seed}-train${.num_train}-val${.num_val}-size${.size}"


@dataclass
class DataConfig:
    root: str = "${.synthetic.dir}"  # a folder (mounted volume) or an fsspec URL
    synthetic: SyntheticConfig = field(default_factory=SyntheticConfig)
    # The node cache on local disk, shared by all ranks and workers of a node; null = none.
    cache_dir: Optional[str] = "${run.root}/${run.name}/data_cache"
    cache_limit_gb: float = 50.0  # hard budget, 10^9 bytes; least recently used files go
    on_bad_file: OnBadFile = OnBadFile.skip  # a corrupt/unreadable file: skip it, or fail
    read_retries: int = 5  # per file, on transient volume errors, with exponential backoff
    retry_backoff_seconds: float = 0.1
    reindex: bool = False  # list the volume again instead of reusing the stored index
    global_batch_size: int = 128  # samples consumed by one optimizer step, over all ranks
    val_batch_size: int = 256
    num_workers: int = 2
    prefetch_factor: int = 4  # batches each worker decodes ahead
    prefetch_threads: int = 16  # threads fetching upcoming files into the cache
    prefetch_batches: int = 8  # how many batches ahead those threads fetch
    image_size: int = 64
    crop_scale_min: float = 0.35  # RandomResizedCrop's lower area bound


@dataclass
class StrategyConfig:
    name: StrategyName = StrategyName.single
    # ddp: gradients are all-reduced in buckets of this size while backward still runs.
    ddp_bucket_cap_mb: float = 25.0
    # fsdp: modules of these classes (by class name) are sharded as units of their own, so
    # only one block's parameters are gathered at a time; what is left goes to the root.
    fsdp_wrap: List[str] = field(
        default_factory=lambda: ["BasicBlock", "Bottleneck", "TinyBlock"])
    # fsdp: free gathered parameters after each unit's forward (and gather them again for
    # backward): less memory for one more all-gather per unit.
    fsdp_reshard_after_forward: bool = True
    # Every collective gives up after this long (never torch's 30-minute default): a dead or
    # frozen peer fails the group, and torchrun restarts it.
    timeout_seconds: float = 300.0
    # Joining the group: peers may still be starting (importing torch, loading data), so
    # this is longer; a rank that never shows up still fails the round after it.
    init_timeout_seconds: float = 600.0


@dataclass
class OptimConfig:
    name: OptimizerName = OptimizerName.sgd
    lr: float = 0.1
    weight_decay: float = 5e-4
    momentum: float = 0.9
    nesterov: bool = True
    betas: List[float] = field(default_factory=lambda: [0.9, 0.999])


@dataclass
class SchedulerConfig:
    name: SchedulerName = SchedulerName.cosine
    warmup_steps: int = 100
    min_lr_ratio: float = 0.0  # cosine floor, as a fraction of the peak lr
    step_epochs: int = 3  # step: multiply lr by gamma every step_epochs epochs
    gamma: float = 0.1


@dataclass
class TrainerConfig:
    max_epochs: int = 10  # the planned length: the lr schedule spans it
    max_steps: Optional[int] = None  # stop early at this optimizer step (the schedule is kept)
    device: Device = Device.auto
    precision: Precision = Precision.auto
    grad_accum_steps: int = 1
    grad_clip_norm: Optional[float] = None
    label_smoothing: float = 0.0
    val_every_epochs: int = 1
    log_every_steps: int = 10
    save_final_weights: bool = True


@dataclass
class CheckpointConfig:
    enabled: bool = True
    # The durable tier: a mounted path or an fsspec URL. Default: inside the run directory.
    dir: str = "${run.root}/${run.name}/checkpoints"
    # The fast local tier (NVMe): DCP writes here, a background upload copies to `dir`.
    # null = write straight to `dir` (right when `dir` is itself a local disk).
    staging_dir: Optional[str] = None
    interval_steps: int = 100
    auto_interval: bool = False  # choose the interval by Young/Daly from the measured stall
    mtbf_hours: float = 4.0  # mean time between failures of the whole job
    keep_last: int = 3
    async_mode: AsyncMode = AsyncMode.thread
    resume: ResumeMode = ResumeMode.auto
    commit_timeout_s: float = 600.0  # rank 0 waits this long for every rank's marker


@dataclass
class LoggerConfig:
    name: LoggerName = LoggerName.mlflow
    # None: MLflow's own default (MLFLOW_TRACKING_URI, else sqlite:///mlflow.db in the cwd).
    tracking_uri: Optional[str] = None
    experiment_name: str = "goodput-trainer"


@dataclass
class AuditConfig:
    # One file for all ranks: a JSON line per optimizer step per rank (data/ledger.py).
    ledger: Optional[str] = None


@dataclass
class HealthConfig:
    """Rollback on bad steps, replica checks, and the hang watchdog (train/health.py)."""

    enabled: bool = True
    spike_factor: float = 10.0  # a loss above this x the running median is a spike
    median_window: int = 50  # steps in that running median (saved in checkpoints)
    min_history: int = 10  # spikes are only judged once the window holds this many losses
    max_rollbacks: int = 3  # per process lifetime; one more bad step fails the run
    replica_check_steps: int = 100  # DDP: compare a parameter checksum across ranks; 0 = off
    hang_seconds: float = 600.0  # a rank with no progress for this long dumps stacks, exits
    preflight: bool = True  # check the device and the collectives before training


@dataclass
class Config:
    seed: int = 0
    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    strategy: StrategyConfig = field(default_factory=StrategyConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    audit: AuditConfig = field(default_factory=AuditConfig)
    health: HealthConfig = field(default_factory=HealthConfig)


def _matches(key: str, prefixes: List[str]) -> bool:
    return any(key == p or key.startswith(p + ".") for p in prefixes)


def default_run_name(experiment: Optional[str], overrides: List[str], excludes: List[str],
                     keep_excluded: bool = False) -> str:
    """The experiment name plus the overrides that change what is trained.

    `keep_excluded` is set for multirun jobs: a sweep over an otherwise ignored key must
    still give every job its own directory, so nothing but Hydra's own keys is dropped.
    """
    kept = []
    for override in overrides:
        key = override.split("=", 1)[0].lstrip("+~")
        if key == "experiment" or _matches(key, ["hydra", "run"]):
            continue
        if not keep_excluded and _matches(key, excludes):
            continue
        kept.append(override.lstrip("+~").replace("/", "_"))
    name = experiment or "default"
    if kept:
        name += "-" + ",".join(sorted(kept))
    if len(name) > 120:  # keep directory names legal; the hash keeps them distinct
        digest = hashlib.sha1(name.encode()).hexdigest()[:10]
        name = f"{name[:100]}-{digest}"
    return name


def _resolve_run_name(*, _root_: Any) -> str:
    try:
        hydra_cfg = HydraConfig.get()
    except ValueError:  # composed outside @hydra.main (tests, notebooks)
        return "default"
    return default_run_name(
        experiment=hydra_cfg.runtime.choices.get("experiment"),
        overrides=list(hydra_cfg.overrides.task),
        excludes=list(_root_.run.exclude_keys),
        keep_excluded=hydra_cfg.mode == RunMode.MULTIRUN,
    )


def register_configs() -> None:
    """Register the schema and the resolvers; safe to call more than once."""
    if not OmegaConf.has_resolver("goodput.run_name"):
        OmegaConf.register_new_resolver("goodput.run_name", _resolve_run_name)
    register_launch_resolvers()
    ConfigStore.instance().store(name="base_config", node=Config)

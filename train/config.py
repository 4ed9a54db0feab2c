"""Typed configuration: the schema every YAML file in `conf/` is merged onto.

Hydra validates overrides against these dataclasses, so a misspelt key (`optim.lrr=0.1`) or
a bad value (`trainer.device=gpu`) fails at start with Hydra's own one-line message, before
any work is done. Numeric keys carry their allowed range (`bounded`), which `validate` checks
right after composing.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import os
import re
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Dict, List, Optional, Sequence, get_type_hints

from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from checkpointing.options import MIN_KEEP_LAST, AsyncMode, CheckpointFormat
from checkpointing.plan import LARGEST as PLAN_LARGEST
from data.cache import default_cache_dir
from data.errors import OnBadFile
from data.locality import CacheUse
from common.redact import strip_credentials
from train.errors import ConfigError
from train.cluster.rank_dirs import register_resolvers as register_launch_resolvers
from train.cluster.preemption import DEFAULT_STOP_SIGNALS


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




class ResumeMode(str, Enum):
    auto = "auto"  # resume when a complete checkpoint exists
    required = "required"  # fail without one
    never = "never"  # refuse to start where checkpoints exist


class StrategyName(str, Enum):
    single = "single"  # one process
    ddp = "ddp"  # DistributedDataParallel: replicated parameters, averaged gradients
    fsdp = "fsdp"  # FSDP2 fully_shard: parameters, gradients and optimizer state sharded
    # In-band recovery on torchft: each data-parallel replica group is its own torchrun job
    # under a lighthouse; a failed group drops out of the step and rejoins live
    # (train/recovery/replicas.py)
    ddp_ft = "ddp_ft"


class StopSignal(str, Enum):
    """A signal that stops a run at a committed checkpoint (train/cluster/preemption.py)."""

    SIGTERM = "SIGTERM"
    SIGINT = "SIGINT"
    SIGHUP = "SIGHUP"
    SIGQUIT = "SIGQUIT"
    SIGUSR1 = "SIGUSR1"
    SIGUSR2 = "SIGUSR2"


class LoggerName(str, Enum):
    mlflow = "mlflow"
    none = "none"


class Direction(str, Enum):
    maximize = "maximize"
    minimize = "minimize"


SEED_MAX = 2**32 - 1  # numpy's seeds are 32-bit
# Far above any sane wait, far below where a timeout overflows (timedelta, faulthandler,
# torchft's client: 1e300 crashed, and a huge connect timeout ignored SIGTERM in torchft)
MAX_TIMEOUT_SECONDS = 7 * 24 * 3600.0


@dataclass(frozen=True)
class Bounds:
    """The values a numeric key allows: `ge`/`gt` below, `le`/`lt` above (None: unbounded).

    Hydra checks types only, so without these a `checkpoint.interval_steps=0` or a
    `data.num_workers=-1` would surface as a traceback deep in the run (or, worse, as a quiet
    substitute value); `validate` checks every bounded key at start instead.
    """

    ge: Optional[float] = None
    gt: Optional[float] = None
    le: Optional[float] = None
    lt: Optional[float] = None

    def allows(self, value: float) -> bool:
        return (math.isfinite(value)
                and (self.ge is None or value >= self.ge) and (self.gt is None or value > self.gt)
                and (self.le is None or value <= self.le) and (self.lt is None or value < self.lt))

    def __str__(self) -> str:
        return " and ".join(f"{op} {int(limit) if float(limit).is_integer() else limit}"
                            for op, limit in ((">=", self.ge), (">", self.gt),
                                              ("<=", self.le), ("<", self.lt))
                            if limit is not None)


def bounded(default: Any, **bounds: float) -> Any:
    """A schema field with `Bounds(**bounds)`; a callable `default` is a default factory
    (lists). An Optional field's null is always allowed."""
    metadata = {"bounds": Bounds(**bounds)}
    if callable(default):
        return field(default_factory=default, metadata=metadata)
    return field(default=default, metadata=metadata)


def local_dir(default: Optional[str]) -> Any:
    """A schema field naming a directory on this node's own disk (a cache, a staging tier):
    `validate` refuses a URL there, which would otherwise become a relative local path named
    after the URL, credentials included."""
    return field(default=default, metadata={"local_dir": True})


def place(default: str) -> Any:
    """A schema field naming a directory or a URL the run reads or writes (run.root,
    checkpoint.dir, data.root): `validate` refuses an empty one, which would be the working
    directory (outputs, checkpoints or the dataset index landing in a checkout)."""
    return field(default=default, metadata={"place": True})


def dir_name(default: str) -> Any:
    """A schema field naming one directory inside another (the run inside `run.root`):
    `validate` refuses a value that would land elsewhere (`..`, a `/`) or in the parent
    itself (empty, `.`)."""
    return field(default=default, metadata={"dir_name": True})


def http_url(default: str) -> Any:
    """A schema field naming a server by its http(s) URL: `validate` refuses anything else
    (torchft's client took `garbage` or '' and failed later, as if the server were down)."""
    return field(default=default, metadata={"http_url": True})


HTTP_URL = re.compile(r"https?://(\[[0-9A-Fa-f:.]+\]|[^/\s:\[\]@]+)(:\d{1,5})?/?")

def _check_http_url(key: str, text: str) -> None:
    shown = ascii(strip_credentials(text)[:80])
    if strip_credentials(text) != text:
        # Said apart: with the credentials stripped from the message, the URL shown would
        # look well-formed next to "not an http URL".
        raise ConfigError(f"{key}={shown} holds credentials (not shown): the server takes "
                          f"none; give it as http://HOST:PORT")
    if not HTTP_URL.fullmatch(text):
        raise ConfigError(f"{key}={shown} is not an http URL: give the server as "
                          f"http://HOST:PORT")


MAX_DIR_NAME = 200  # file systems allow 255 bytes; leave room for a suffix


def _dir_name_problem(value: Any) -> Optional[str]:
    text = str(value) if value is not None else ""
    if text in ("", ".", ".."):
        return "is empty, '.' or '..'"
    if "/" in text or "\0" in text:
        return "holds a '/' or a NUL"
    if len(text.encode()) > MAX_DIR_NAME:
        return f"is over {MAX_DIR_NAME} bytes"
    return None


def validate(cfg: DictConfig, schema: Optional[type] = None, prefix: str = "") -> None:
    """Raise `ConfigError` naming the first numeric key outside its `Bounds`, or the first
    `local_dir` key given a URL, or a `dir_name` key that is not one plain directory name:
    the key, the value and the fix, in one line. Hydra builds
    the config without running any dataclass code, so this walks the composed config
    against the schema's fields."""
    schema = schema or Config
    types = get_type_hints(schema)
    for spec in dataclasses.fields(schema):
        key = f"{prefix}{spec.name}"
        if dataclasses.is_dataclass(types[spec.name]):
            validate(cfg[spec.name], types[spec.name], f"{key}.")
            continue
        if spec.metadata.get("local_dir") and "://" in str(cfg[spec.name] or ""):
            raise ConfigError(f"{key}={strip_credentials(str(cfg[spec.name]))} is a URL: it "
                              f"must be a directory on this node's local disk (or null)")
        if spec.metadata.get("local_dir") and str(cfg[spec.name]).strip() == "":
            # Path("") is the working directory: the cache or staging files would land there
            raise ConfigError(f"{key}={ascii(str(cfg[spec.name]))} is empty: give a directory "
                              f"on this node's local disk, or null for none")
        if spec.metadata.get("place") and str(cfg[spec.name]).strip() == "":
            raise ConfigError(f"{key}={ascii(str(cfg[spec.name]))} is empty: name a directory "
                              f"(. for the working directory)")
        if spec.metadata.get("http_url"):
            _check_http_url(key, str(cfg[spec.name]))
        problem = spec.metadata.get("dir_name") and _dir_name_problem(cfg[spec.name])
        if problem:
            raise ConfigError(f"{key}={ascii(strip_credentials(str(cfg[spec.name]))[:80])} "
                              f"{problem}: it must be one plain directory name")
        if "bounds" not in spec.metadata:
            continue
        bounds: Bounds = spec.metadata["bounds"]
        value = cfg[spec.name]
        for item in (value if OmegaConf.is_list(value) else [value]):
            if item is not None and not bounds.allows(item):
                finite = "" if math.isfinite(item) else "a finite number "
                raise ConfigError(f"{key}={value} is out of range: it must be {finite}{bounds}")
    if schema is Config:
        check_replica_group(cfg)


def check_replica_group(cfg: DictConfig) -> None:
    """ddp_ft: this group's id must be one of the planned groups' (it names the group's
    directories and its slot in the lighthouse's quorum)."""
    ft = cfg.strategy.fault_tolerance
    if cfg.strategy.name == StrategyName.ddp_ft and ft.replica_id >= ft.replica_groups:
        raise ConfigError(f"strategy.fault_tolerance.replica_id={ft.replica_id} is not one of "
                          f"the replica_groups={ft.replica_groups} groups: give each group an "
                          f"id in 0..{ft.replica_groups - 1}, or raise replica_groups")


# Overrides that change how a run is executed or observed but not what it trains: they are
# left out of the default run name so that, e.g., extending `trainer.max_steps` resumes the
# same run instead of starting a new one. Prefixes match whole key segments.
DEFAULT_RUN_NAME_EXCLUDES = [
    "trainer.max_steps",
    "trainer.device",
    "trainer.log_every_steps",
    "trainer.save_final_weights",
    "trainer.deterministic",
    "trainer.stop_signals",
    "data.num_workers",
    "data.prefetch_factor",
    "data.cache_dir",
    "data.cache",
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
    "sweep",
    "hydra",
]


@dataclass
class RunConfig:
    # The run's identity: the same name lands in the same output directory (and resumes).
    name: str = dir_name("${goodput.run_name:}")
    root: str = place("outputs")
    exclude_keys: List[str] = field(default_factory=lambda: list(DEFAULT_RUN_NAME_EXCLUDES))


@dataclass
class ModelConfig:
    # Any torchvision classification model: torchvision.models.list_models(torchvision.models)
    name: str = "resnet18"
    # On the classifier's input (it draws from the global RNG)
    dropout: float = bounded(0.0, ge=0, lt=1)


@dataclass
class SyntheticConfig:
    """The embedded shapes dataset, generated on first use when `data.root` is `dir`."""

    num_train: int = bounded(10000, ge=1)
    num_val: int = bounded(2000, ge=1)
    # Image width in pixels; height is 3/4 of it (like ImageNet's 500x375)
    size: int = bounded(96, ge=8)
    seed: int = bounded(0, ge=0, le=SEED_MAX)
    dir: str = "datasets/shapes-seed${.seed}-train${.num_train}-val${.num_val}-size${.size}"


@dataclass
class DataConfig:
    root: str = place("${.synthetic.dir}")  # a folder (mounted volume) or an fsspec URL
    # fsspec's options for a URL's filesystem, e.g. {endpoint_url: ..., key: ..., secret: ...}
    # for an S3-compatible store; secrets among them never reach a log, name or record
    storage_options: Dict[str, Any] = field(default_factory=dict)
    synthetic: SyntheticConfig = field(default_factory=SyntheticConfig)
    # The node cache on local disk, shared by all ranks, workers and runs of a node (default
    # $XDG_CACHE_HOME/goodput-trainer or ~/.cache/goodput-trainer); null = none.
    cache_dir: Optional[str] = local_dir("${goodput.user_cache_dir:}")
    # auto: cache a root on the network (a URL, NFS, a FUSE mount), read one on local disk in
    # place; always / never force it (data/locality.py has the rule)
    cache: CacheUse = CacheUse.auto
    # Hard budget, 10^9 bytes; least recently used files go
    cache_limit_gb: float = bounded(50.0, gt=0)
    on_bad_file: OnBadFile = OnBadFile.skip  # a corrupt/unreadable file: skip it, or fail
    # Per file, on transient volume errors, with exponential backoff
    read_retries: int = bounded(5, ge=0)
    retry_backoff_seconds: float = bounded(0.1, ge=0)
    reindex: bool = False  # list the volume again instead of reusing the stored index
    # Samples consumed by one optimizer step, over all ranks
    global_batch_size: int = bounded(128, ge=1)
    val_batch_size: int = bounded(256, ge=1)
    num_workers: int = bounded(2, ge=0)
    prefetch_factor: int = bounded(4, ge=1)  # batches each worker decodes ahead
    # Threads (0: none) fetching upcoming files into the cache
    prefetch_threads: int = bounded(16, ge=0)
    prefetch_batches: int = bounded(8, ge=1)  # how many batches ahead those threads fetch
    # Far above any model's input: the bound stops a typo (100000) from allocating tens of GB
    # per image inside a data worker.
    image_size: int = bounded(64, ge=8, le=4096)
    # RandomResizedCrop's lower area bound: the shapes must stay mostly in view to keep their label
    crop_scale_min: float = bounded(0.5, gt=0, le=1)
    # A file whose header declares more pixels (width x height) is a bad file, refused before
    # it is decoded: a 1.4 KB JPEG can declare 30000x30000 and take gigabytes to decode.
    # The default is PIL's own decompression-bomb limit (Image.MAX_IMAGE_PIXELS).
    max_image_pixels: int = bounded(89_478_485, ge=1)


@dataclass
class FaultToleranceConfig:
    """strategy=ddp_ft: this replica group's place under the torchft lighthouse."""

    # The lighthouse every replica group reports to (torchft_lighthouse --bind ...)
    lighthouse: str = http_url("http://127.0.0.1:29510")
    # This group's id, 0..replica_groups-1: names its run and checkpoint subdirectories
    replica_id: int = bounded(0, ge=0)
    # The width the job is meant to run at: fewer participants count as degraded time
    replica_groups: int = bounded(2, ge=1)
    # Below this many participating groups no step is trained: the group waits for more
    min_replicas: int = bounded(1, ge=1)
    # A quorum (and a first join, while peers start), or the wait for min_replicas groups,
    # gives up after this long
    quorum_timeout_seconds: float = bounded(60.0, gt=0, le=MAX_TIMEOUT_SECONDS)
    # Cross-group collectives and the copy of a healthy peer's state when rejoining
    timeout_seconds: float = bounded(30.0, gt=0, le=MAX_TIMEOUT_SECONDS)
    # To the lighthouse and the peers
    connect_timeout_seconds: float = bounded(10.0, gt=0, le=MAX_TIMEOUT_SECONDS)


@dataclass
class StrategyConfig:
    name: StrategyName = StrategyName.single
    # ddp: gradients are all-reduced in buckets of this size while backward still runs.
    ddp_bucket_cap_mb: float = bounded(25.0, gt=0)
    # fsdp: modules of these classes (by class name) are sharded as units of their own, so
    # only one block's parameters are gathered at a time; what is left goes to the root.
    fsdp_wrap: List[str] = field(
        default_factory=lambda: ["BasicBlock", "Bottleneck", "TinyBlock"])
    # fsdp: free gathered parameters after each unit's forward (and gather them again for
    # backward): less memory for one more all-gather per unit.
    fsdp_reshard_after_forward: bool = True
    # Every collective gives up after this long (never torch's 30-minute default): a dead or
    # frozen peer fails the group, and torchrun restarts it.
    timeout_seconds: float = bounded(300.0, gt=0, le=MAX_TIMEOUT_SECONDS)
    # Joining the group: peers may still be starting (importing torch, loading data), so
    # this is longer; a rank that never shows up still fails the round after it.
    init_timeout_seconds: float = bounded(600.0, gt=0, le=MAX_TIMEOUT_SECONDS)
    fault_tolerance: FaultToleranceConfig = field(default_factory=FaultToleranceConfig)


@dataclass
class OptimConfig:
    name: OptimizerName = OptimizerName.sgd
    lr: float = bounded(0.1, gt=0)
    weight_decay: float = bounded(5e-4, ge=0)
    momentum: float = bounded(0.9, ge=0, lt=1)
    nesterov: bool = True
    betas: List[float] = bounded(lambda: [0.9, 0.999], ge=0, lt=1)  # each of them


@dataclass
class SchedulerConfig:
    name: SchedulerName = SchedulerName.cosine
    warmup_steps: int = bounded(100, ge=0)
    min_lr_ratio: float = bounded(0.0, ge=0, le=1)  # cosine floor, as a fraction of the peak lr
    step_epochs: int = bounded(3, ge=1)  # step: multiply lr by gamma every step_epochs epochs
    gamma: float = bounded(0.1, gt=0)


@dataclass
class TrainerConfig:
    max_epochs: int = bounded(10, ge=1)  # the planned length: the lr schedule spans it
    # Stop early at this optimizer step (the schedule is kept)
    max_steps: Optional[int] = bounded(None, ge=1)
    device: Device = Device.auto
    precision: Precision = Precision.auto
    grad_accum_steps: int = bounded(1, ge=1)
    grad_clip_norm: Optional[float] = bounded(None, gt=0)
    label_smoothing: float = bounded(0.0, ge=0, lt=1)
    val_every_epochs: int = bounded(1, ge=1)
    log_every_steps: int = bounded(10, ge=1)
    save_final_weights: bool = True
    # true: same config + seed = same bits on CPU, so a resumed run is bit-identical to an
    # uninterrupted one (torch refuses ops without a deterministic kernel). false: torch may
    # pick faster nondeterministic kernels; runs then differ in the last bits.
    deterministic: bool = True
    # Each of these stops the run at the next step boundary, saves, and exits 75 (requeue):
    # a scheduler's notice, Ctrl-C, a lost terminal, the time-limit warnings of SLURM's
    # --signal and submitit. A signal left out keeps its default action (it kills at once).
    stop_signals: List[StopSignal] = field(
        default_factory=lambda: [StopSignal(name) for name in DEFAULT_STOP_SIGNALS])


@dataclass
class CheckpointConfig:
    enabled: bool = True
    # The durable tier: a mounted path or an fsspec URL. Default: inside the run directory.
    dir: str = place("${run.root}/${run.name}/checkpoints")
    # fsspec's options for `dir`, as data.storage_options for data.root
    storage_options: Dict[str, Any] = field(default_factory=dict)
    # The fast local tier (NVMe): DCP writes here, a background upload copies to `dir`.
    # null = write straight to `dir` (right when `dir` is itself a local disk).
    staging_dir: Optional[str] = local_dir(None)
    interval_steps: int = bounded(100, ge=1)
    # Re-pick the interval after each save: the exact failure model's optimum
    # (checkpointing.plan) for the measured stall and step time, and mtbf_hours.
    auto_interval: bool = False
    # Mean time between failures of the whole job; at most the planner's largest input (an
    # mtbf_hours of 1e308 is infinite in seconds and crashed the run at its first save)
    mtbf_hours: float = bounded(4.0, gt=0, le=PLAN_LARGEST / 3600)
    # From a failure to training again, until a resume measures it: auto_interval's log
    # predicts goodput with it (the interval itself does not depend on it).
    restart_seconds: float = bounded(60.0, gt=0, le=PLAN_LARGEST)
    keep_last: int = bounded(3, ge=MIN_KEEP_LAST)
    async_mode: AsyncMode = AsyncMode.thread
    # How tensors are stored (checkpointing/writer.py); checkpoints of either format load.
    format: CheckpointFormat = CheckpointFormat.dcp
    resume: ResumeMode = ResumeMode.auto
    # Rank 0 waits this long for every rank's marker
    commit_timeout_s: float = bounded(600.0, gt=0, le=MAX_TIMEOUT_SECONDS)


@dataclass
class LoggerConfig:
    name: LoggerName = LoggerName.mlflow
    # None: MLflow's own default (MLFLOW_TRACKING_URI, else sqlite:///mlflow.db in the cwd).
    tracking_uri: Optional[str] = None
    experiment_name: str = "goodput-trainer"
    # CPU, memory, disk, network (and GPU, with nvidia-ml-py) every system_metrics_seconds
    # (mlflow's monitors, psutil)
    system_metrics: bool = True
    system_metrics_seconds: float = bounded(10.0, gt=0, le=3600)
    # While the store fails, how long between attempts (each may block a step for seconds)
    retry_seconds: float = bounded(30.0, gt=0, le=3600)
    # The final model as an MLflow model (`model`; seconds, most of it importing
    # torch.export); registered under this name in MLflow's model registry when one is given
    log_model: bool = True
    registered_model_name: Optional[str] = None


@dataclass
class AuditConfig:
    # One file for all ranks: a JSON line per optimizer step per rank (data/ledger.py).
    ledger: Optional[str] = None


@dataclass
class HealthConfig:
    """Rollback on bad steps, replica checks, and the hang watchdog (train/recovery/health.py)."""

    enabled: bool = True
    spike_factor: float = bounded(10.0, gt=1)  # a loss above this x the running median is a spike
    median_window: int = bounded(50, ge=1)  # steps in that running median (saved in checkpoints)
    # Spikes are only judged once the window holds this many losses
    min_history: int = bounded(10, ge=1)
    max_rollbacks: int = bounded(3, ge=0)  # per process lifetime; one more bad step fails the run
    # DDP: compare a parameter checksum across ranks (ddp_ft: and across groups); 0 = off
    replica_check_steps: int = bounded(100, ge=0)
    # A rank with no progress for this long dumps stacks and exits; 0 = no watchdog.
    hang_seconds: float = bounded(600.0, ge=0, le=MAX_TIMEOUT_SECONDS)
    preflight: bool = True  # check the device and the collectives before training


@dataclass
class SweepConfig:
    """What a run hands a Hydra sweeper (hparams_search/optuna.yaml)."""

    # The metric `main` returns: its value at the run's last step (validation runs there)
    objective: str = "val/top1"
    direction: Direction = Direction.maximize  # for sweepers that optimize the objective


@dataclass
class Config:
    seed: int = bounded(0, ge=0, le=SEED_MAX)
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
    sweep: SweepConfig = field(default_factory=SweepConfig)


def _matches(key: str, prefixes: Sequence[str]) -> bool:
    return any(key == p or key.startswith(p + ".") for p in prefixes)


# Keys that say where a run's files go, not what it trains: never part of a run's name, not
# even in a sweep (a path would nest inside the name, and may carry credentials).
LOCATION_KEYS = ["hydra", "run", "checkpoint.dir", "checkpoint.staging_dir",
                 "checkpoint.storage_options", "data.cache_dir", "data.storage_options",
                 "audit.ledger", "logger.tracking_uri"]
# Keys that never change what is trained, whatever `run.exclude_keys` says: where a run's
# files go, and how it checkpoints and audits itself.
NEVER_TRAINED = [*LOCATION_KEYS, "checkpoint", "audit"]


def changes_training(key: str, excludes: Sequence[str]) -> bool:
    """Whether the (dotted) config key `key` changes what is trained, given the keys a
    run's identity leaves out (`run.exclude_keys`)."""
    return not _matches(key, [*excludes, *NEVER_TRAINED])

_UNSAFE = re.compile(r"[^A-Za-z0-9._+-]+")  # a name stays one portable, shell-safe word


def _name_part(text: str, limit: int = 32) -> str:
    """`text` as part of a run name: verbatim when short and plain, else its last path (or
    URL path) component made plain, `~`, and a hash of the whole (without credentials).
    `~` is never verbatim, so a shortened part never equals a plain one; the hash keeps
    shortened ones distinct."""
    clean = strip_credentials(text)
    if 0 < len(clean) <= limit and not _UNSAFE.search(clean):
        return clean
    path = re.split(r"[?#]", clean, maxsplit=1)[0].rstrip("/")  # a URL's query goes too
    tail = _UNSAFE.sub("_", path.rsplit("/", 1)[-1])[:24]
    return f"{tail}~{hashlib.sha1(clean.encode()).hexdigest()[:8]}"


MAX_RUN_NAME = 120  # a directory name, an MLflow run name and a line of `ls`
SWEPT_KEYS_ENV = "GOODPUT_SWEPT_KEYS"  # set by the sweep's record (train/tracking/sweep_record.py)


def default_run_name(experiment: Optional[str], overrides: List[str], excludes: List[str],
                     keep_excluded: bool = False, swept: Sequence[str] = ()) -> str:
    """The experiment name plus the overrides that change what is trained.

    `keep_excluded` is set for multirun jobs: a sweep over an otherwise ignored key must
    still give every job its own directory, so only `LOCATION_KEYS` are dropped. The keys a
    sweep varies (`swept`) lead, so a job's value shows first; the parts are joined by `,`,
    which no part holds, so the name still tells every set of overrides apart. Past
    MAX_RUN_NAME the parts that do not fit give way to a hash of the whole name.
    """
    # A key given twice counts once, with its last value, as Hydra applies it.
    last = {override.lstrip("+~").partition("=")[0]: override for override in overrides}
    kept = []
    for override in last.values():
        key, has_value, value = override.lstrip("+~").partition("=")
        if key == "experiment" or _matches(key, LOCATION_KEYS):
            continue
        if not keep_excluded and _matches(key, excludes):
            continue
        part = _name_part(key, 64) + (f"={_name_part(value)}" if has_value else "")
        kept.append((key not in swept, part))
    name = _name_part(experiment or "default", 64)
    if not kept:
        return name
    parts = [part for _, part in sorted(kept)]
    full = f"{name}-{','.join(parts)}"
    if len(full) <= MAX_RUN_NAME:
        return full
    digest = hashlib.sha1(full.encode()).hexdigest()[:10]
    room = MAX_RUN_NAME - len(name) - len(digest) - 3  # "-", then "-" before the digest
    shown = []
    for part in parts:  # whole parts only: a value cut short would read as another value
        if len(",".join([*shown, part])) > room:
            break
        shown.append(part)
    return f"{name}-{','.join(shown)}-{digest}" if shown else f"{name}-{digest}"


def swept_keys() -> List[str]:
    """The keys the sweep running this job varies, as its record handed them on."""
    return [key for key in os.environ.get(SWEPT_KEYS_ENV, "").split(",") if key]


def _resolve_run_name(*, _root_: Any) -> str:
    try:
        hydra_cfg = HydraConfig.get()
    except ValueError:  # composed outside @hydra.main (tests, notebooks)
        return "default"
    multirun = hydra_cfg.mode == RunMode.MULTIRUN
    return default_run_name(
        experiment=hydra_cfg.runtime.choices.get("experiment"),
        overrides=list(hydra_cfg.overrides.task),
        excludes=list(_root_.run.exclude_keys),
        keep_excluded=multirun,
        swept=swept_keys() if multirun else (),
    )


def register_configs() -> None:
    """Register the schema and the resolvers; safe to call more than once."""
    if not OmegaConf.has_resolver("goodput.run_name"):
        OmegaConf.register_new_resolver("goodput.run_name", _resolve_run_name)
    if not OmegaConf.has_resolver("goodput.user_cache_dir"):
        OmegaConf.register_new_resolver("goodput.user_cache_dir", default_cache_dir)
    register_launch_resolvers()
    ConfigStore.instance().store(name="base_config", node=Config)

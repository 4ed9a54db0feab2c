"""How the model is spread over the ranks: `strategy=single | ddp | fsdp | ddp_ft`.

`parallelize` wraps the model once, after it is on its device and before the optimizer sees
its parameters (FSDP replaces them with sharded DTensors). The helpers below are what the
loop needs to stay correct under every strategy: when gradients are reduced, and which
forwards every rank has to run together.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import ContextManager, Dict

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.nn.parallel import DistributedDataParallel

from train.config import StrategyConfig, StrategyName
from train.cluster.world import World
from train.errors import ConfigError
from train.recovery.replicas import Replicas

# FSDP2 averages fp32/bf16 gradients inside the reduce-scatter, with ReduceOp.AVG
# (_fsdp_collectives._get_gradient_divide_factors). pytorch#162338 (open) reports gloo summing
# there instead: gradients x world size, silently. On torch 2.14.1 gloo averages: at 2, 3 and
# 4 ranks reduce_scatter with AVG returned the mean for fp32, bf16 and fp64 at every size
# tried, and fully_shard's gradients equalled one process's, uneven shards included. So no
# workaround (a forced SUM plus division would cost NCCL its fused average).
# tests/test_parallel.py compares FSDP's weights with one process's and with a simulated
# summed gradient, so a torch that brings the bug back fails there.


def parallelize(model: torch.nn.Module, cfg: StrategyConfig, world: World,
                device: torch.device) -> torch.nn.Module:
    """The model wrapped for `cfg.name`: as it is, in DDP, or sharded in place by FSDP2.
    Under ddp_ft it stays as it is: `train.recovery.replicas` averages its gradients across ranks
    and replica groups once it has joined them."""
    name = StrategyName(cfg.name)
    if name == StrategyName.ddp_ft:
        return model
    if name == StrategyName.single:
        if world.world_size > 1:
            # Each rank would train its own copy on its slice of the data, never averaged.
            raise ConfigError(f"strategy=single trains one process but {world.world_size} "
                              f"ranks were launched: use strategy=ddp or strategy=fsdp")
        return model
    if name == StrategyName.ddp:
        # The model already sits on this rank's current device (init_world selected it).
        device_ids = [torch.cuda.current_device()] if device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=device_ids,
                                       bucket_cap_mb=cfg.ddp_bucket_cap_mb)
    mesh = init_device_mesh(device.type, (world.world_size,))
    wrap = set(cfg.fsdp_wrap)
    # Collected first: fully_shard changes each module's class (and so its name).
    units = [m for m in model.modules() if type(m).__name__ in wrap and m is not model]
    for unit in units:
        fully_shard(unit, mesh=mesh, reshard_after_forward=cfg.fsdp_reshard_after_forward)
    fully_shard(model, mesh=mesh, reshard_after_forward=cfg.fsdp_reshard_after_forward)
    return model


def runs_in_lockstep(model: torch.nn.Module, replicas: Replicas) -> bool:
    """Whether forwards and backwards are collectives: every rank must run as many as every
    other one, or the group hangs until its timeout."""
    return isinstance(model, (DistributedDataParallel, FSDPModule)) or replicas.lockstep


def gradient_sync(model: torch.nn.Module, replicas: Replicas,
                  enabled: bool) -> ContextManager:
    """Around one micro-batch's forward and backward: whether its backward reduces gradients
    across ranks. Accumulating micro-batches only need the last one to, and that reduction
    carries the sum of all of them (ddp_ft: `replicas` average it, with the other groups)."""
    if replicas.lockstep:
        return replicas.averaging() if enabled else nullcontext()
    if isinstance(model, DistributedDataParallel) and not enabled:
        return model.no_sync()
    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(enabled)
    return nullcontext()


def full_state_dict(model: torch.nn.Module) -> Dict[str, torch.Tensor]:
    """The model's plain state dict (no `module.` prefixes, whole tensors on the CPU) on rank
    0, an empty one elsewhere. Under FSDP it gathers shards: every rank must call it."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(model, options=options)

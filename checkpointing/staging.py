"""Staging: the copy of the state an async save takes before the loop may go on.

The copy goes into CPU buffers allocated at the first save and reused by every later one,
so a save blocks the loop for one copy into warm memory, not an allocating one (page faults
cost several times the copy). Plain tensors (single process, DDP) are copied by one
`torch._foreach_copy_` over buffers kept by their place in the state dict; DCP's own stager,
which walks the state in Python object by object, is left only the tensor subclasses (FSDP's
DTensors), whose structure it knows how to rebuild. Buffers are pinned on CUDA (fast
device-to-host copies) and in shared memory for `async_mode=process`, so handing the snapshot
to DCP's process copies nothing more. Reuse is safe because at most one save is in flight:
`CheckpointManager.save` waits for the previous one first.
"""

from __future__ import annotations

import copy
from typing import Any, Dict, List, Tuple

import torch
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

Path = Tuple[Any, ...]  # where a value sits in the nested state dict


class WarmStager(DefaultStager):
    _synchronize_after_execute = False  # the copy is done when stage() returns

    def __init__(self, share_memory: bool) -> None:
        self._pinned = torch.cuda.is_available()
        self._shared = share_memory
        super().__init__(StagingOptions(use_pinned_memory=self._pinned,
                                        use_shared_memory=share_memory,
                                        use_async_staging=False, use_non_blocking_copy=False))
        self._buffers: Dict[Path, torch.Tensor] = {}

    def stage(self, state_dict: Dict[str, Any], **kwargs: Any) -> Dict[str, Any]:
        """A copy of `state_dict` whose tensors live in this stager's CPU buffers."""
        buffers: Dict[Path, torch.Tensor] = {}
        sources: List[torch.Tensor] = []
        subclassed: Dict[Path, torch.Tensor] = {}
        staged = self._rebuild(state_dict, (), buffers, sources, subclassed)
        if buffers:
            with torch.no_grad():
                torch._foreach_copy_(list(buffers.values()), sources)
        self._buffers = buffers  # a buffer whose tensor left the state is let go
        if subclassed:
            for path, tensor in super().stage(subclassed, **kwargs).items():
                _put(staged, path, tensor)
        return staged

    def _rebuild(self, value: Any, path: Path, buffers: Dict[Path, torch.Tensor],
                 sources: List[torch.Tensor], subclassed: Dict[Path, torch.Tensor]) -> Any:
        """`value` with each plain tensor replaced by its buffer (copied into later), each
        tensor subclass by None (staged by DCP's stager later), and other leaves copied
        (a tuple too: DCP keeps it whole)."""
        if isinstance(value, dict):
            return {k: self._rebuild(v, path + (k,), buffers, sources, subclassed)
                    for k, v in value.items()}
        if isinstance(value, list):
            return [self._rebuild(v, path + (i,), buffers, sources, subclassed)
                    for i, v in enumerate(value)]
        if not isinstance(value, torch.Tensor):
            return copy.deepcopy(value)
        if type(value) not in (torch.Tensor, torch.nn.Parameter) or (
                value.layout != torch.strided):
            subclassed[path] = value
            return None
        buffers[path] = self._buffer_for(path, value)
        sources.append(value.detach())
        return buffers[path]

    def _buffer_for(self, path: Path, tensor: torch.Tensor) -> torch.Tensor:
        buffer = self._buffers.get(path)
        if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
            buffer = torch.empty_like(tensor, device="cpu", requires_grad=False)
            if self._pinned:
                buffer = buffer.pin_memory()
            if self._shared:
                buffer.share_memory_()
        return buffer

    def close(self) -> None:
        self._buffers = {}
        super().close()


def _put(state: Any, path: Path, value: Any) -> None:
    for key in path[:-1]:
        state = state[key]
    state[path[-1]] = value

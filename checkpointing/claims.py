"""What a checkpoint claims, checked: the step its directory names, and the model its card
describes. Resume (train/resume/checkpoint.py) and export apply the same checks, so a checkpoint
one of them refuses the other cannot pass off as good.

The model card records the model's tensors as a count and a digest of their names, shapes
and dtypes (`tensor_schema`), taken from the live model when the run starts; a checkpoint
whose model entries differ (keys dropped, a dtype changed, another model's files) no longer
matches it.
"""

from __future__ import annotations

import hashlib
from typing import Any, Dict, Mapping, Sequence, Tuple

import torch

SCHEMA_KEY = "tensors"  # the model card's entry


class ClaimMismatch(ValueError):
    """A checkpoint is not what it claims to be (one line)."""


def tensor_schema(entries: Mapping[str, Tuple[Sequence[int], torch.dtype]]) -> Dict[str, Any]:
    """{"count", "sha256"} of {name: (shape, dtype)}: the same for a live state dict and for
    the entries a checkpoint's `.metadata` declares for it."""
    text = "\n".join(f"{name} {tuple(int(d) for d in shape)} {dtype}"
                     for name, (shape, dtype) in sorted(entries.items()))
    return {"count": len(entries), "sha256": hashlib.sha256(text.encode()).hexdigest()}


def schema_of_state(state: Mapping[str, torch.Tensor]) -> Dict[str, Any]:
    """`tensor_schema` of a model's state dict (its tensors' global shapes under FSDP)."""
    return tensor_schema({k: (v.shape, v.dtype) for k, v in state.items()
                          if isinstance(v, torch.Tensor)})


def check_step(name: str, recorded: Any, step: int) -> None:
    """The step a checkpoint records is the one its directory `name` names."""
    if not isinstance(recorded, int) or isinstance(recorded, bool) or recorded != step:
        raise ClaimMismatch(f"checkpoint {name} records step {str(recorded)[:40]}: it was not "
                            f"written by this trainer at step {step}")


def check_model(name: str, card: Mapping[str, Any], schema: Dict[str, Any]) -> None:
    """The model entries of checkpoint `name` (their `tensor_schema`) are those its model
    card recorded. A card without a record (an older checkpoint) is taken as it is."""
    recorded = card.get(SCHEMA_KEY)
    if recorded is None:
        return
    if recorded != schema:
        count = recorded.get("count") if isinstance(recorded, dict) else None
        how = (f"{schema['count']} model tensors where its model card records "
               f"{str(count)[:40]}"
               if count != schema["count"] else
               f"{schema['count']} model tensors as its model card records, but other names, "
               f"shapes or dtypes")
        raise ClaimMismatch(f"checkpoint {name} holds {how}: it is not the model it was "
                            f"saved as")

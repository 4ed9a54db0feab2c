"""`python -m checkpointing.export CKPT OUT`: a checkpoint's model as a plain state dict.

CKPT is one `step_X` directory, or a `checkpoint.dir` (then its newest complete step is
used: highest parsed step that verifies, never file times). OUT is written with `torch.save`
(or as safetensors when it ends in `.safetensors`) and holds exactly the keys of the
model's own `state_dict()`, so `torchvision.models.get_model(name, num_classes=...)
.load_state_dict(torch.load(OUT), strict=True)` accepts it. The model card (class names,
num_classes, the normalization's mean and std, the image size), when the checkpoint records
one, rides along where no loader trips on it: an attribute of the saved dict, or the
safetensors metadata; `read_model_card(OUT)` reads it from either.

The checkpoint is verified against its commit markers first (an incomplete or altered one
is refused), and loading never executes code from it: `.metadata` goes through the
restricted unpickler and the tensors are read into tensors allocated here. What resume
checks, export checks too (checkpointing.claims): the step recorded inside is the one the
directory names, and the model tensors (names, shapes, dtypes) are those the model card
recorded, so re-signed markers over other files are refused.

Exit code 0 when OUT is written; 2, with one line on stderr, when CKPT is missing, holds no
complete checkpoint or an unsafe one, or OUT cannot be written.

    $ python -m checkpointing.export outputs/resnet/checkpoints resnet18.safetensors
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import warnings
from collections import OrderedDict
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from safetensors.torch import save as safetensors_bytes
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from checkpointing import commit
from checkpointing.claims import ClaimMismatch, check_model, check_step, tensor_schema
from checkpointing.manager import dcp_cause, quiet_single_process_dcp
from checkpointing.safe_load import (SafeFileSystemReader, SafeLoadPlanner,
                                     UnsafeCheckpointError, load_metadata)
from checkpointing.storage import Store, StoreUnavailable
from common.files import atomic_file
from common.redact import one_line, strip_credentials

MODEL_KEY = "model"
# The checkpoint's record of the model card (train/app.py): JSON in the `run` header
CARD_KEY = "run.config.model_card"
STEP_KEY = "trainer.step"  # the step the trainer recorded (train/resume/stateful.py)

log = logging.getLogger("checkpointing.export")


class ExportError(Exception):
    """Why a checkpoint cannot be exported (one line)."""


def locate(ckpt: str) -> Tuple[Store, str, int]:
    """(store, step directory name, step) of the checkpoint CKPT names, verified."""
    store = Store(ckpt)
    if not store.fs.isdir(store.root):
        raise FileNotFoundError(f"{ckpt} is not a directory")
    name = os.path.basename(store.root.rstrip("/"))
    if m := commit.STEP_DIR.match(name):
        parent = (os.path.dirname(store.root) if store.is_local
                  else ckpt.rstrip("/").rpartition("/")[0])
        store, step = Store(parent), int(m.group(1))
        try:
            commit.verify(store, name, step)
        except commit.Incomplete as why:
            raise ExportError(f"{ckpt} is incomplete: {why}") from None
        return store, name, step
    newest = next(commit.find_complete(store, log), None)
    if newest is None:
        raise ExportError(f"{ckpt} holds no complete checkpoint (step_* directories that "
                          f"verify)")
    return store, commit.step_dir_name(newest[0]), newest[0]


def load_model_state(checkpoint_dir: Path) -> Dict[str, torch.Tensor]:
    """The `model` entries of a local DCP checkpoint, without its prefix."""
    try:
        with open(checkpoint_dir / ".metadata", "rb") as f:
            metadata = load_metadata(f)
    except UnsafeCheckpointError as err:  # replaced since it was verified
        raise ExportError(f"{checkpoint_dir / '.metadata'} is unsafe: {err}") from None
    except Exception as err:  # damaged since it was verified: any unpickling failure
        raise ExportError(f"{checkpoint_dir / '.metadata'} is unreadable "
                          f"({type(err).__name__})") from None
    prefix = MODEL_KEY + "."
    entries = {k: v for k, v in metadata.state_dict_metadata.items() if k.startswith(prefix)}
    if not entries:
        raise ExportError(f"{checkpoint_dir} holds no '{MODEL_KEY}' state")
    not_tensors = sorted(k for k, v in entries.items()
                         if not isinstance(v, TensorStorageMetadata))
    if not_tensors:
        raise ExportError(f"{not_tensors[0]} is not a tensor: not a model state dict")
    # The sizes come from the file: a forged one must not allocate more than it could fill.
    wanted = sum(v.size.numel() * v.properties.dtype.itemsize for v in entries.values())
    stored = sum(p.stat().st_size for p in checkpoint_dir.glob("*.distcp"))
    if wanted > stored:
        raise ExportError(f"{checkpoint_dir / '.metadata'} declares {wanted} bytes of model "
                          f"tensors but the checkpoint's files hold {stored}")
    # Flat keys: DCP matches them to the saved fully qualified names directly. The rest of
    # the checkpoint (optimizer, RNG, ...) is simply not requested, so never read.
    state: Dict[str, Any] = {k: torch.empty(v.size, dtype=v.properties.dtype)
                             for k, v in entries.items()}
    if CARD_KEY in metadata.state_dict_metadata:
        state[CARD_KEY] = ""
    if STEP_KEY in metadata.state_dict_metadata:
        state[STEP_KEY] = None
    try:
        with warnings.catch_warnings():  # loading in one process is the intent here
            quiet_single_process_dcp()
            dcp.load(state, storage_reader=SafeFileSystemReader(str(checkpoint_dir)),
                     planner=SafeLoadPlanner(), no_dist=True)
    except (CheckpointException, UnsafeCheckpointError) as err:
        raise ExportError(f"loading {checkpoint_dir} failed: {one_line(dcp_cause(err))}") from None
    card = card_of(state.pop(CARD_KEY), checkpoint_dir) if CARD_KEY in state else None
    check_claims(checkpoint_dir, state.pop(STEP_KEY, None), card,
                 {k[len(prefix):]: (v.size, v.properties.dtype) for k, v in entries.items()})
    return with_model_card({k[len(prefix):]: v for k, v in state.items()}, card)


def check_claims(checkpoint_dir: Path, recorded_step: Any, card: Optional[Dict[str, Any]],
                 entries: Dict[str, Tuple[Any, torch.dtype]]) -> None:
    """What resume checks too (checkpointing.claims): the step recorded inside is the one
    the directory names, and the model tensors are those the model card recorded."""
    try:
        if match := commit.STEP_DIR.match(checkpoint_dir.name):
            check_step(checkpoint_dir.name, recorded_step, int(match.group(1)))
        if card is not None:
            check_model(checkpoint_dir.name, card, tensor_schema(entries))
    except ClaimMismatch as err:
        raise ExportError(str(err)) from None


def card_of(text: Any, checkpoint_dir: Path) -> Dict[str, Any]:
    """The model card a checkpoint records: a JSON object, or the checkpoint is refused."""
    try:
        card = json.loads(text)
    except (TypeError, ValueError, RecursionError):
        card = None
    if not isinstance(card, dict):
        raise ExportError(f"{checkpoint_dir}'s model card ({CARD_KEY}) is not a JSON object: "
                          f"not a checkpoint this trainer wrote")
    return card


def with_model_card(state: Dict[str, torch.Tensor],
                    card: Optional[Dict[str, Any]]) -> Dict[str, torch.Tensor]:
    """`state` with `card` as its `model_card` attribute: torch.save keeps it and
    `torch.load(weights_only=True)` restores it, while load_state_dict never sees it."""
    out: Dict[str, torch.Tensor] = OrderedDict(state)
    if card is not None:
        out.model_card = card  # type: ignore[attr-defined]
    return out


def read_model_card(path: Path) -> Optional[Dict[str, Any]]:
    """The model card an exported file (or model_final.pt) carries, if any."""
    if path.suffix == ".safetensors":
        with safe_open(str(path), framework="pt") as f:
            text = (f.metadata() or {}).get("model_card")
        return json.loads(text) if text else None
    return getattr(torch.load(path, weights_only=True, map_location="cpu"), "model_card", None)


def write(state: Dict[str, torch.Tensor], out: Path, step: int) -> None:
    """Whole or not at all: a failed export never leaves a truncated OUT behind."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(out) as f:
        if out.suffix == ".safetensors":
            card = getattr(state, "model_card", None)
            f.write(safetensors_bytes(state, metadata={
                "format": "pt", "step": str(step),
                **({"model_card": json.dumps(card)} if card else {})}))
        else:
            torch.save(state, f)


def export(ckpt: str, out: Path) -> Tuple[str, int]:
    """Export the model of CKPT to OUT; returns (the step directory used, its step)."""
    store, name, step = locate(ckpt)
    if store.is_local:
        state = load_model_state(Path(store.path(name)))
    else:
        # DCP's reader is for local files: fetch the step, and re-verify the copy so what
        # is loaded is what was checked. Only what the markers list: anyone who can write
        # to the bucket can put anything more under the prefix (GBs, nested keys).
        with tempfile.TemporaryDirectory(prefix="goodput-export-") as tmp:
            _, listed = commit.verified_files(store, name, step, read_contents=False)
            files = [*listed, *map(commit.marker_name, commit.markers_present(store, name))]
            unsafe = [f for f in files if f in (".", "..") or os.path.basename(f) != f]
            if unsafe:
                raise ExportError(f"{name}'s markers list {unsafe[0]!r}: not a file name")
            os.makedirs(os.path.join(tmp, name))
            store.fs.get([store.path(name, f) for f in files],
                         [os.path.join(tmp, name, f) for f in files])
            try:
                commit.verify(Store(tmp), name, step)
            except commit.Incomplete as why:
                raise ExportError(f"the downloaded copy of {name} is incomplete: {why}") \
                    from None
            state = load_model_state(Path(tmp, name))
    write(state, out, step)
    return store.url_of(name), step


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m checkpointing.export",
        description="Write a checkpoint's model as a plain state dict that "
                    "torchvision.models.get_model(name, num_classes=N).load_state_dict "
                    "accepts. The checkpoint is verified first; nothing in it is executed.")
    parser.add_argument("ckpt", metavar="CKPT",
                        help="a step_X checkpoint directory, or a checkpoint.dir (then the "
                             "newest complete step is used); a path or an fsspec URL")
    parser.add_argument("out", metavar="OUT", type=Path,
                        help="the file to write: torch.save format, or safetensors when it "
                             "ends in .safetensors")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    try:
        source, step = export(args.ckpt, args.out)
    except (ExportError, OSError, StoreUnavailable) as err:  # retrying cannot help
        print(f"error: {strip_credentials(str(err))}", file=sys.stderr)
        return 2
    except Exception as err:  # an object store's client has errors of its own (botocore's)
        print(f"error: cannot read {args.ckpt} ({one_line(dcp_cause(err))}): check "
              f"the URL, the endpoint and the credentials", file=sys.stderr)
        return 2
    print(f"exported the model of {source} (step {step}) to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The schema in train/config.py is the one source of every default: a YAML file in conf/
sets only what differs from it, so a default changed in the schema is never shadowed by a
stale copy (nor contradicted by one)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator, List, Tuple

import pytest
from omegaconf import OmegaConf

from train.config import Config

CONF = Path(__file__).resolve().parents[1] / "conf"
GLOBAL_PACKAGE = "# @package _global_"
NOT_SCHEMA = {"defaults", "hydra"}  # Hydra's own keys, merged onto no dataclass


def leaves(node: Any, prefix: str = "") -> Iterator[Tuple[str, Any]]:
    """(dotted key, value) for every non-mapping value under `node`; lists are values."""
    if not isinstance(node, dict):
        yield prefix.rstrip("."), node
        return
    for key, value in node.items():
        yield from leaves(value, f"{prefix}{key}.")


def yaml_files() -> List[Path]:
    """Our config files; conf/hydra/ holds Hydra's own groups (launchers, sweepers), which
    merge under `hydra.`, onto no dataclass of ours."""
    return sorted(p for p in CONF.rglob("*.yaml") if p.relative_to(CONF).parts[0] != "hydra")


def schema_keys(path: Path) -> Iterator[Tuple[str, Any]]:
    """The schema keys `path` sets, as full dotted keys: a group file is merged under its
    group's name, a `_global_` package (and the primary config) at the root."""
    text = path.read_text()
    group = path.parent.relative_to(CONF).as_posix()
    at_root = group == "." or text.startswith(GLOBAL_PACKAGE)
    content = OmegaConf.to_container(OmegaConf.load(path), resolve=False) or {}
    if at_root:
        content = {k: v for k, v in content.items() if k not in NOT_SCHEMA}
    yield from leaves(content, "" if at_root else f"{group}.")


def test_the_walk_sees_every_kind_of_yaml():
    """Guards the test below against passing vacuously: it must see group files, a global
    package and keys that differ from the schema."""
    seen = {path.relative_to(CONF).as_posix(): list(schema_keys(path)) for path in yaml_files()}
    assert "experiment/resnet.yaml" in seen and "model/tiny_cnn.yaml" in seen
    assert ("optim.lr", 2.0e-3) in seen["optim/adamw.yaml"]
    assert ("model.name", "tiny_cnn") in seen["model/tiny_cnn.yaml"]


@pytest.mark.parametrize("path", yaml_files(), ids=lambda p: p.relative_to(CONF).as_posix())
def test_a_yaml_sets_only_what_differs_from_the_schema_defaults(path):
    defaults = OmegaConf.to_container(OmegaConf.structured(Config), resolve=False,
                                      enum_to_str=True)
    repeated = []
    for key, value in schema_keys(path):
        default: Any = defaults
        for part in key.split("."):
            default = default[part]
        if value == default:
            repeated.append(f"{key}={value}")
    assert not repeated, f"{path.name} repeats the schema's defaults: {', '.join(repeated)}"
    head = path.read_text().splitlines()[:3]
    assert any("only what differs" in line for line in head), (
        f"{path.name} does not say at its top that it lists only what differs from the schema")

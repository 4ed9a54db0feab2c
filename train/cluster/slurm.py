"""SLURM's environment, read as torchrun's: `srun python -m train ...` needs no torchrun.

Each task srun starts is one rank: `SLURM_PROCID` (rank), `SLURM_NTASKS` (world size),
`SLURM_LOCALID` (local rank), `SLURM_NODEID` (node rank), and the first host of the step's
nodes (`SLURM_STEP_NODELIST`, else the job's: an `srun -w node[3-4]` step in a larger
allocation runs no task on the job's first node) hosts the rendezvous store, on
`MASTER_PORT` when set, else a port derived from the job id (every task of the job derives
the same). No torch import here:
train/cluster/rank_dirs.py reads the rank while Hydra composes.
"""

from __future__ import annotations

import re
from typing import Dict, Iterator, List, Mapping, Tuple, Union

from train.errors import ConfigError

MAX_HOSTS = 65536  # more than any cluster; a larger range is a malformed list
_HOST = re.compile(r"[A-Za-z0-9._-]*")
_RANGE = re.compile(r"([0-9]{1,9})(?:-([0-9]{1,9}))?")  # ASCII: \d takes "١" and "１"
MAX_BRACKETS = 16  # per name; each is one level of `_hosts`' recursion
PORT_BASE, PORT_SPAN = 15000, 20000  # MASTER_PORT = PORT_BASE + job id % PORT_SPAN
# Where the hosts are listed, first found first: the step's, then the job's (two names)
NODELISTS = ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")


Span = Tuple[int, int, int]  # (zero-padded width, first, last) of a bracket's numbers
Pattern = List[Union[str, List[Span]]]  # literal text and bracket lists, in order


def _split_top_level(text: str) -> List[str]:
    """'a[1-2],b' -> ['a[1-2]', 'b']: commas outside brackets separate patterns."""
    parts, depth, start = [], 0, 0
    for i, char in enumerate(text):
        depth += (char == "[") - (char == "]")
        if depth not in (0, 1):
            raise ValueError("brackets out of order")
        if char == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth:
        raise ValueError("an unclosed '['")
    return parts + [text[start:]]


def _spans(spec: str) -> List[Span]:
    """'01-03,7' -> [(2, 1, 3), (1, 7, 7)]: widths from each range's first bound."""
    spans = []
    for item in spec.split(","):
        match = _RANGE.fullmatch(item)
        if not match:
            raise ValueError(f"'[{spec[:40]}]' holds {item[:20]!r}, not a number or a range a-b")
        low, high = match.group(1), match.group(2) or match.group(1)
        if int(high) < int(low):
            raise ValueError(f"the range {item} runs backwards")
        spans.append((len(low), int(low), int(high)))
    return spans


def _parse(pattern: str) -> Pattern:
    """'rack[1-2]-n[01-03]' -> ['rack', [(1, 1, 2)], '-n', [(2, 1, 3)]]."""
    parsed: Pattern = []
    while pattern:
        head, bracket, rest = pattern.partition("[")
        if not _HOST.fullmatch(head):
            raise ValueError(f"{head[:40]!r} is not a host name")
        parsed.append(head)
        if not bracket:
            break
        spec, closing, pattern = rest.partition("]")
        if not closing or not spec:
            raise ValueError("an empty or unclosed '[...]'")
        parsed.append(_spans(spec))
        if len(parsed) > 2 * MAX_BRACKETS:
            raise ValueError(f"a name holds more than {MAX_BRACKETS} '[...]'")
    if not parsed:
        raise ValueError("it holds an empty name")
    return parsed


def _hosts(parsed: Pattern, prefix: str = "") -> Iterator[str]:
    """The hosts of a parsed pattern, lazily: a range is never materialized."""
    if not parsed:
        yield prefix
        return
    first, rest = parsed[0], parsed[1:]
    if isinstance(first, str):
        yield from _hosts(rest, prefix + first)
        return
    for width, low, high in first:
        for number in range(low, high + 1):
            yield from _hosts(rest, f"{prefix}{number:0{width}d}")


def iter_hostlist(text: str) -> Iterator[str]:
    """SLURM's compressed host list ('node[01-03,07],gpu1') one host at a time. The whole
    list is checked first: ValueError, saying why, for a malformed one."""
    if not text.strip():
        raise ValueError("it is empty")
    patterns = [_parse(p) for p in _split_top_level(text.strip())]
    return (host for parsed in patterns for host in _hosts(parsed))


def expand_hostlist(text: str, limit: int = MAX_HOSTS) -> List[str]:
    """Every host of a SLURM host list; ValueError past `limit` hosts (a huge range is a
    malformed list, not a reason to fill memory)."""
    hosts = []
    for host in iter_hostlist(text):
        if len(hosts) == limit:
            raise ValueError(f"it names more than {limit} hosts")
        hosts.append(host)
    return hosts


def first_host(text: str) -> str:
    """The first host of a SLURM host list, without expanding the rest."""
    return next(iter_hostlist(text))


SRUN_SETS_IT = "run the trainer under srun, which sets it, or under torchrun"


def _integer(env: Mapping[str, str], name: str, low: int = 0, high: int = 10**9 - 1,
             fix: str = SRUN_SETS_IT) -> int:
    value = env.get(name, "")
    if not re.fullmatch(r"[0-9]{1,9}", value.strip()) or not low <= int(value) <= high:
        within = f"from {low} to {high}" if high < 10**9 - 1 else f">= {low}"
        raise ConfigError(f"{name}={value[:40]!r} is not a whole number {within}: {fix}")
    return int(value)


def torchrun_environment(env: Mapping[str, str]) -> Dict[str, str]:
    """torchrun's variables for this SLURM task (RANK, WORLD_SIZE, LOCAL_RANK, GROUP_RANK,
    MASTER_ADDR, MASTER_PORT), or {} where there is nothing to translate: torchrun set its
    own (`srun torchrun ...`), or the job runs a single task."""
    if "RANK" in env or "SLURM_PROCID" not in env or env.get("SLURM_NTASKS", "1") == "1":
        return {}
    world_size = _integer(env, "SLURM_NTASKS", low=1)
    rank = _integer(env, "SLURM_PROCID")
    if rank >= world_size:
        raise ConfigError(f"SLURM_PROCID={rank} is not below SLURM_NTASKS={world_size}")
    variable = next((name for name in NODELISTS if name in env), NODELISTS[1])
    nodelist = env.get(variable, "")
    try:
        master = first_host(nodelist)
    except ValueError as err:
        raise ConfigError(f"{variable}={nodelist[:80]!r} is not a host list ({err}): run the "
                          f"trainer under srun, or set MASTER_ADDR") from None
    port = (_integer(env, "MASTER_PORT", low=1, high=65535, fix="set it to a free TCP port, "
                     "or unset it for one derived from the job id") if env.get("MASTER_PORT")
            else PORT_BASE + _integer(env, "SLURM_JOB_ID") % PORT_SPAN)
    return {"RANK": str(rank), "WORLD_SIZE": str(world_size),
            "LOCAL_RANK": str(_integer(env, "SLURM_LOCALID")),
            "GROUP_RANK": str(_integer(env, "SLURM_NODEID")),
            "MASTER_ADDR": env.get("MASTER_ADDR") or master, "MASTER_PORT": str(port)}

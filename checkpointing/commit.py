"""The commit protocol: what makes a checkpoint directory *complete*, and finding the newest.

Layout under `checkpoint.dir`:

    step_000000100/                   a committed checkpoint (only ever by rename)
        .metadata  __0_0.distcp ...   DCP's files
        commit_rank_0.json ...        one marker per rank: its files, sizes and checksums
    .step_000000200.partial-<id>/     an attempt in progress, or left by a crash

Each rank writes its marker only after its own files are durable; rank 0 renames the
partial directory to `step_X` once every rank's marker is there. A checkpoint is complete
when `.metadata` and a marker for every rank are present and every file verifies, so a crash
at any instant leaves the older checkpoints as they were, and nothing half-written is ever
named `step_X`. "Newest" is the highest parsed step, never a file time or string order.

An object store cannot rename (`Store.renames`): there each rank uploads its files straight
into `step_X/`, then its marker, so a `step_X/` may be half-written, and only verification
tells. Every marker names the save attempt that wrote it and all must name the same one: a
marker left by a dead attempt never vouches for this attempt's files, nor theirs for it.
"""

from __future__ import annotations

import heapq
import json
import re
from dataclasses import dataclass
from itertools import islice
from typing import Dict, Iterator, List, Mapping, Optional, Tuple

from checkpointing.checksums import marker_entry, parse_marker_entry
from checkpointing.safe_load import METADATA_FILE, UnsafeCheckpointError, load_metadata, shown
from checkpointing.storage import Store

STEP_DIR = re.compile(r"^step_(\d{9})$")
PARTIAL_DIR = re.compile(r"^\.step_(\d{9})\.(partial|replaced)-[\w.-]+$")
MARKER = re.compile(r"^commit_rank_(\d+)\.json$")
# A marker lists one rank's few files: a few KB. Anything near this is not a marker.
MAX_MARKER_BYTES = 16 << 20


def step_dir_name(step: int) -> str:
    return f"step_{step:09d}"


def partial_dir_name(step: int, attempt: str) -> str:
    return f".{step_dir_name(step)}.partial-{attempt}"


def marker_name(rank: int) -> str:
    return f"commit_rank_{rank}.json"


@dataclass(frozen=True)
class FileRecord:
    size: int
    checksum: str  # hex digest
    algorithm: str = "sha256"  # what markers recorded before XXH3 (checkpointing.checksums)

    @classmethod
    def from_marker(cls, name: str, entry: object) -> "FileRecord":
        size, algorithm, checksum = parse_marker_entry(name, entry)
        return cls(size, checksum, algorithm)


def write_marker(store: Store, directory: str, step: int, rank: int, world_size: int,
                 files: Dict[str, FileRecord], attempt: Optional[str] = None) -> None:
    body = {"step": step, "rank": rank, "world_size": world_size, "attempt": attempt,
            "files": {name: marker_entry(r.size, r.algorithm, r.checksum)
                      for name, r in files.items()}}
    store.write_bytes(store.path(directory, marker_name(rank)),
                      json.dumps(body, indent=1, sort_keys=True).encode())


def markers_present(store: Store, directory: str) -> List[int]:
    return sorted(int(m.group(1)) for n in store.listdir(store.path(directory))
                  if (m := MARKER.match(n)))


class Incomplete(Exception):
    """Why a checkpoint directory is not complete (one line)."""


def verify(store: Store, directory: str, step: int, read_contents: bool = True) -> int:
    """Raise `Incomplete` unless `directory` is a complete checkpoint of `step`; returns the
    world size it was saved at (see `verified_files`)."""
    return verified_files(store, directory, step, read_contents)[0]


def verified_files(store: Store, directory: str, step: int, read_contents: bool = True
                   ) -> Tuple[int, Dict[str, FileRecord]]:
    """Raise `Incomplete` unless `directory` is a complete checkpoint of `step`.

    Returns the world size it was saved at, and the files its markers list. With
    `read_contents=False` only the markers and the presence and sizes of the files they
    list are checked (`checked_layout`), and no other file is read: for what this job has
    just written, whose checksums came from the bytes on their way to the files and whose
    `.metadata` it wrote itself (unpickling it safely costs about a quarter of a second for
    ResNet-50's state). The contents are `first_mismatch` and `check_metadata`, which
    ranks may share (`share_of`).
    """
    world_size, listed = checked_layout(store, directory, step)
    if read_contents:
        failure = first_mismatch(store, directory, listed, sorted(listed))
        if failure is not None:
            raise Incomplete(describe_mismatch(sorted(listed), failure))
        check_metadata(store, directory, listed)
    return world_size, listed


def checked_layout(store: Store, directory: str, step: int,
                   markers: Optional[Mapping[str, bytes]] = None
                   ) -> Tuple[int, Dict[str, FileRecord]]:
    """The world size and listed files of `directory`, or `Incomplete`: every marker of one
    save attempt of `step` is there and well formed, and every file they list is a regular
    file of the size they record. Reads the markers only, but those in `markers` (by name:
    already read, by the commit's wait for them)."""
    # One listing gives every file's type and size: per rank, rank 0 then reads only its
    # marker.
    entries = store.entries(store.path(directory))
    if METADATA_FILE not in entries:
        raise Incomplete(f"{METADATA_FILE} is missing")
    ranks = sorted(int(m.group(1)) for n in entries if (m := MARKER.match(n)))
    if not ranks:
        raise Incomplete("no commit marker")
    listed: Dict[str, FileRecord] = {}
    world_size: Optional[int] = None
    attempts = set()
    for rank in ranks:
        name = marker_name(rank)
        _check_regular_file(entries, name)
        if entries[name][1] > MAX_MARKER_BYTES:
            raise Incomplete(f"{name} is over {MAX_MARKER_BYTES >> 20} MB: not a commit marker")
        try:
            raw = (markers or {}).get(name)
            body = json.loads(raw if raw is not None
                              else store.read_bytes(store.path(directory, name)))
            files = {n: FileRecord.from_marker(n, f) for n, f in body["files"].items()}
            marker_step, marker_world = int(body["step"]), int(body["world_size"])
            attempts.add(str(body.get("attempt")))
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError,
                OverflowError) as err:  # OverflowError: a size of 1e400
            raise Incomplete(f"{name} is unreadable "
                             f"({type(err).__name__}: {str(err)[:200]})") from None
        if marker_step != step:
            raise Incomplete(f"{name} belongs to step {marker_step}")
        if marker_world < 1:
            raise Incomplete(f"{name} says world size {marker_world}")
        if rank >= marker_world or body.get("rank") != rank:
            # The attempt is in every real marker for anyone to copy: a marker beyond the
            # world, or under another rank's name, was planted, and would vouch for its files
            raise Incomplete(f"{name} is not the marker of rank {rank} of a world of "
                             f"{marker_world}")
        if world_size not in (None, marker_world):
            raise Incomplete("commit markers disagree on the world size")
        world_size = marker_world
        twice = next((n for n in files if n in listed), None)
        if twice is not None:  # each rank lists its own files: which record would count?
            raise Incomplete(f"{shown(twice)} is listed by more than one commit marker")
        listed.update(files)
    assert world_size is not None
    if len(attempts) > 1:
        raise Incomplete("commit markers of different save attempts (one is still uploading, "
                         "or died)")
    present = set(ranks)  # a marker's world size may be 10**12: never build range() whole
    missing_ranks = list(islice((r for r in range(world_size) if r not in present), 8))
    if missing_ranks:
        raise Incomplete(f"commit marker of rank(s) {missing_ranks} missing")
    if METADATA_FILE not in listed:  # unsigned, it could be anything, even a FIFO
        raise Incomplete(f"no commit marker lists {METADATA_FILE}")
    for name, record in sorted(listed.items()):
        _check_regular_file(entries, name)
        size = entries[name][1]
        if size != record.size:
            raise Incomplete(f"{shown(name)} is {size} bytes, its marker says {record.size}")
    return world_size, listed


# What `first_mismatch` found wrong with a file
MISMATCH, UNREADABLE = 0, 1


def first_mismatch(store: Store, directory: str, listed: Dict[str, FileRecord],
                   names: List[str]) -> Optional[Tuple[int, int]]:
    """(position in `names`, MISMATCH or UNREADABLE) of the first of `names` whose bytes do
    not match the checksum `listed` records for it, or None when all match. A file the
    store cannot read (after its retries; an object store's client raises errors of its
    own) is UNREADABLE: not to be trusted either. Never raises for a file: the ranks that
    share a check must all reach the collective that follows it."""
    for position, name in enumerate(names):
        record = listed[name]
        try:
            if store.checksum(store.path(directory, name), record.algorithm) != record.checksum:
                return position, MISMATCH
        except Exception:
            return position, UNREADABLE
    return None


def describe_mismatch(names: List[str], failure: Tuple[int, int]) -> str:
    """The one-line reason for `first_mismatch`'s finding over `names`."""
    position, kind = failure
    if kind == UNREADABLE:
        return f"{shown(names[position])} could not be read"
    return f"{shown(names[position])} does not match its checksum (altered or swapped)"


def share_of(listed: Dict[str, FileRecord], rank: int, world_size: int) -> List[str]:
    """The listed files rank `rank` of `world_size` checks, sorted: every file goes to one
    rank, the largest first to the rank with the fewest bytes so far, so each reads about
    its part of the bytes. The same on every rank (a pure function of the markers)."""
    loads = [(0, r) for r in range(world_size)]  # a heap of (bytes so far, rank)
    mine = []
    for name, record in sorted(listed.items(), key=lambda item: (-item[1].size, item[0])):
        taken, owner = heapq.heappop(loads)
        if owner == rank:
            mine.append(name)
        heapq.heappush(loads, (taken + record.size, owner))
    return sorted(mine)


def check_metadata(store: Store, directory: str, listed: Dict[str, FileRecord]) -> None:
    """Raise `Incomplete` unless `.metadata` unpickles safely (`checkpointing.safe_load`) and
    every file it stores data in is one a marker lists. Only once its checksum verified."""
    try:
        with store.open_file(store.path(directory, METADATA_FILE)) as f:
            metadata = load_metadata(f, reuse=True)  # the load that follows reads it
    except UnsafeCheckpointError as err:
        raise Incomplete(f"{METADATA_FILE} is unsafe: {err}") from None
    except Exception as err:  # any unpickling failure means the file is damaged
        raise Incomplete(f"{METADATA_FILE} is unreadable ({type(err).__name__})") from None
    needed = {info.relative_path for info in (metadata.storage_data or {}).values()}
    unlisted = sorted(needed - set(listed))
    if unlisted:
        raise Incomplete(f"{shown(unlisted[0])} is used by {METADATA_FILE} but no marker "
                         f"lists it")


def _check_regular_file(entries: Dict[str, Tuple[bool, int]], name: str) -> None:
    """A checkpoint holds regular files only: a link may point at /dev/zero, a FIFO or a
    file outside the checkpoint, and reading those hangs or leaks. A name is shown as one
    short line (`shown`): a marker may list anything, a newline that forges a log line of
    its own or megabytes of one name."""
    if name not in entries:
        raise Incomplete(f"{shown(name)} is missing")
    if not entries[name][0]:
        raise Incomplete(f"{shown(name)} is not a regular file (a symlink, device or "
                         f"directory)")


def committed_steps(store: Store) -> List[int]:
    """Steps that have a `step_X` directory, newest first (complete or not)."""
    return sorted((int(m.group(1)) for n in store.listdir() if (m := STEP_DIR.match(n))),
                  reverse=True)


def find_complete(store: Store, log=None) -> Iterator[Tuple[int, int]]:
    """(step, world size) of each complete checkpoint, newest first, verifying as it goes.

    A directory that fails verification is skipped with one log line saying why.
    """
    for step in committed_steps(store):
        try:
            world_size = verify(store, step_dir_name(step), step)
        except (Incomplete, OSError) as why:  # OSError: unreadable after the store's retries
            if log:
                log.warning("checkpoint %s is incomplete (%s): skipping it",
                            store.url_of(step_dir_name(step)), why)
            continue
        yield step, world_size

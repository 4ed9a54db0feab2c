"""`python -m checkpointing.verify DIR`: re-check every checkpoint under DIR, one line each.

A scrub for silent corruption: each `step_X` directory of a `checkpoint.dir` (a path or an
fsspec URL) is verified against its commit markers' sizes and checksums (XXH3-64, or sha256
in markers of earlier versions), newest step first; attempts that never committed
(`.step_X.partial-*`, `.step_X.replaced-*`) are listed as ignored, since resume never reads
them. Exit code 0 when the newest checkpoint is complete, 1 otherwise (including no
checkpoint at all), 2 when DIR does not exist or cannot be read (a dead endpoint, a
URL holding credentials: those belong in the storage's environment variables).

    $ python -m checkpointing.verify outputs/resnet/checkpoints
    step_000000200  complete  (2 files, 134.2 MB, world size 1)
    step_000000100  INCOMPLETE: __0_0.distcp does not match its checksum (altered or swapped)
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import List, Optional, Tuple

from checkpointing import commit
from checkpointing.storage import Store, StoreUnavailable
from common.redact import one_line


def listed_files(store: Store, directory: str) -> Tuple[int, int]:
    """(number of files, total bytes) that the commit markers of `directory` list."""
    sizes = {}
    for rank in commit.markers_present(store, directory):
        body = json.loads(store.read_bytes(store.path(directory, commit.marker_name(rank))))
        sizes.update({name: int(f["size"]) for name, f in body["files"].items()})
    return len(sizes), sum(sizes.values())


def check(store: Store, name: str, step: int) -> Tuple[bool, str]:
    """(complete?, the report line) for the committed checkpoint directory `name`."""
    try:
        world_size, files = commit.verified_files(store, name, step)
    except commit.Incomplete as why:
        return False, f"{name}  INCOMPLETE: {why}"
    except OSError as err:  # a flaky mount or a permission problem is not "complete" either
        return False, f"{name}  INCOMPLETE: unreadable ({type(err).__name__}: {err})"
    size = sum(f.size for f in files.values())
    return True, (f"{name}  complete  ({len(files)} files, {size / 1e6:.1f} MB, world size "
                  f"{world_size})")


def scrub(store: Store) -> Tuple[List[str], bool]:
    """The report lines, newest step first, and whether the newest checkpoint is complete."""
    entries = []  # (step, committed first, name)
    for name in store.listdir():
        if m := commit.STEP_DIR.match(name):
            entries.append((int(m.group(1)), 1, name))
        elif m := commit.PARTIAL_DIR.match(name):
            entries.append((int(m.group(1)), 0, name))
    lines, newest_ok = [], None
    for step, committed, name in sorted(entries, reverse=True):
        if not committed:
            kind = commit.PARTIAL_DIR.match(name).group(2)
            lines.append(f"{name}  {kind} (ignored)")
            continue
        ok, line = check(store, name, step)
        lines.append(line)
        if newest_ok is None:
            newest_ok = ok
    return lines, bool(newest_ok)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m checkpointing.verify",
        description="Re-check every checkpoint under DIR against its commit markers' sizes "
                    "and checksums; one line per checkpoint, newest first. Exit code "
                    "0 when the newest checkpoint is complete, 1 otherwise.")
    parser.add_argument("dir", metavar="DIR",
                        help="a checkpoint.dir (holding step_* directories): a path or an "
                             "fsspec URL")
    args = parser.parse_args(argv)
    from checkpointing.manager import dcp_cause  # here: the manager imports this module
    try:
        store = Store(args.dir)
        if not store.fs.isdir(store.root):
            print(f"error: {args.dir} is not a directory", file=sys.stderr)
            return 2
        lines, newest_ok = scrub(store)
    except StoreUnavailable as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except Exception as err:  # an object store's client has errors of its own (botocore's)
        print(f"error: cannot read {args.dir} ({one_line(dcp_cause(err))}): check "
              f"the URL, the endpoint and the credentials", file=sys.stderr)
        return 2
    for line in lines:
        print(line)
    if not lines:
        print(f"no checkpoint in {args.dir}")
    return 0 if newest_ok else 1


if __name__ == "__main__":
    sys.exit(main())

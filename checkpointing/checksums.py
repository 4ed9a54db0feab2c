"""The checksums of the commit markers.

A marker records each file as `{"size": n, "<algorithm>": "<hex digest>"}`. Saves record
XXH3-64 (`WRITE_ALGORITHM`), taken from the bytes on their way to the file
(`checkpointing.writer`), so a save never reads its files back; markers of earlier versions
record sha256, and both verify. The checksum catches torn, truncated, bit-flipped or swapped
files, not a forger: whoever can write the checkpoint folder can rewrite a marker as well
(keeping code from running is the safe loader's job). XXH3 hashes any buffer at tens of GB/s
here; google-crc32c, as fast on `bytes`, takes nothing else, so torch's memoryviews would
cost a copy each (benchmarks/checkpoint_stall.py measures both).
"""

from __future__ import annotations

import hashlib
import re
from typing import Any, BinaryIO, Dict, Tuple

import xxhash

from common.files import CHUNK

WRITE_ALGORITHM = "xxh3_64"
_HASHERS = {"xxh3_64": xxhash.xxh3_64, "sha256": hashlib.sha256}
_HEX_DIGITS = {"xxh3_64": 16, "sha256": 64}
ALGORITHMS = tuple(sorted(_HASHERS))


class UnknownChecksum(ValueError):
    """A marker entry without exactly one checksum this version can check."""


def hasher(algorithm: str) -> Any:
    """A fresh hashlib-style object (`update`, `hexdigest`) of `algorithm`."""
    return _HASHERS[algorithm]()


def checksum_of(f: BinaryIO, algorithm: str) -> str:
    """The hex digest of what is left to read in `f`, read in chunks."""
    digest = hasher(algorithm)
    for chunk in iter(lambda: f.read(CHUNK), b""):
        digest.update(chunk)
    return digest.hexdigest()


def marker_entry(size: int, algorithm: str, checksum: str) -> Dict[str, Any]:
    return {"size": size, algorithm: checksum}


def parse_marker_entry(name: str, entry: Any) -> Tuple[int, str, str]:
    """(size, algorithm, hex digest) of a marker's entry for file `name`. A marker is input:
    ValueError (UnknownChecksum included) or TypeError when the entry is not well formed."""
    if not isinstance(entry, dict):
        raise TypeError(f"the entry of {name!r} is not an object")
    size = int(entry["size"])
    algorithms = [a for a in ALGORITHMS if a in entry]
    if len(algorithms) != 1:
        others = sorted(str(k) for k in entry if k != "size")[:3]
        raise UnknownChecksum(f"{name!r} has {'no' if not algorithms else 'more than one'} "
                              f"checksum this version checks (it lists {others!r}; known: "
                              f"{', '.join(ALGORITHMS)})")
    algorithm = algorithms[0]
    digest = entry[algorithm]
    if not (isinstance(digest, str)
            and re.fullmatch(f"[0-9a-f]{{{_HEX_DIGITS[algorithm]}}}", digest)):
        raise ValueError(f"the {algorithm} checksum of {name!r} is malformed")
    return size, algorithm, digest

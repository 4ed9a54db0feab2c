"""Whether a dataset root is already on this node's local disk, which decides whether the node
cache copies it (`data.cache=auto`).

The rule: a URL (`s3://`, `http://`, `slow://`, ...) is remote, except `file://`; a path is
local when the filesystem it resolves onto (symlinks followed; the mount in
/proc/self/mountinfo with the device number the path's stat gives) is a disk or memory
filesystem in `LOCAL_FILESYSTEMS`. Everything else is remote: NFS, SMB, FUSE mounts of
network storage (`fuse.rclone`, `fuse.sshfs`, `fuse.gcsfuse`, ...), parallel filesystems
(Lustre, GPFS, CephFS), and any type not listed, so an unknown filesystem costs disk,
never step time. Where /proc/self/mountinfo cannot be read (not Linux) a path counts as
remote too.
"""

from __future__ import annotations

import os
import re
import urllib.parse
from dataclasses import dataclass
from enum import Enum
from typing import List, Optional

MOUNTINFO = "/proc/self/mountinfo"  # this process's mount namespace (a container sees its own)

# Filesystems whose reads are as fast as the cache's own disk: caching them only copies.
# `fuseblk` is FUSE over a local block device (ntfs-3g, exfat-fuse); `overlay` is a
# container's root. Squashfs is absent: on clusters its image often lives on a network share.
LOCAL_FILESYSTEMS = frozenset({
    "ext2", "ext3", "ext4", "xfs", "btrfs", "zfs", "f2fs", "jfs", "reiserfs", "bcachefs",
    "vfat", "exfat", "ntfs", "ntfs3", "fuseblk", "hfsplus", "apfs", "overlay", "tmpfs",
    "ramfs",
})


class CacheUse(str, Enum):
    """Whether the node cache copies `data.root` (`data.cache`)."""

    auto = "auto"  # a remote root is cached, one on local disk is read in place
    always = "always"  # cached even on local disk (e.g. a slow local disk, a USB drive)
    never = "never"  # read in place even from the network


@dataclass(frozen=True)
class Location:
    """Where a dataset root lives: `local` (read it in place) or not, and why."""

    local: bool
    kind: str  # a filesystem type (`ext4`, `nfs4`, `fuse.rclone`), `url` or `unknown`
    mount_point: Optional[str] = None

    def describe(self) -> str:
        if self.kind == "url":
            return "a URL"
        if self.mount_point is None:
            return "on a filesystem of unknown type (no /proc/self/mountinfo to tell)"
        where = "local" if self.local else "remote"
        return f"on {self.kind} mounted at {self.mount_point} ({where})"


def _unescape(field: bytes) -> str:
    # The kernel writes space, tab, newline and backslash in mount points as octal escapes;
    # one over \377 is no byte: left as written.
    return os.fsdecode(re.sub(rb"\\([0-3][0-7]{2})", lambda m: bytes([int(m.group(1), 8)]),
                              field))


@dataclass(frozen=True)
class Mount:
    device: str  # "major:minor", as os.stat's st_dev gives it
    mount_point: str
    kind: str  # the filesystem type


def parse_mountinfo(text: bytes) -> List[Mount]:
    """The mounts of a /proc/<pid>/mountinfo table, in mount order. A line is `id parent
    major:minor root mount-point options [optional fields...] - type source super-options`."""
    mounts = []
    for line in text.splitlines():
        fields = line.split()
        if b"-" in fields[6:] and len(fields) > fields.index(b"-", 6) + 1:
            kind = fields[fields.index(b"-", 6) + 1]
            mounts.append(Mount(os.fsdecode(fields[2]), _unescape(fields[4]), os.fsdecode(kind)))
    return mounts


def _contains(mount_point: str, path: str) -> bool:
    # By whole components: /mnt/data holds /mnt/data/x, not /mnt/data2.
    return mount_point == "/" or path == mount_point or path.startswith(mount_point + "/")


def _innermost(path: str, mounts: List[Mount]) -> Optional[Mount]:
    # Of several mounts on one point the last mounted is the one seen: ">=" keeps it.
    best = None
    for mount in mounts:
        if _contains(mount.mount_point, path) and (
                best is None or len(mount.mount_point) >= len(best.mount_point)):
            best = mount
    return best


def mount_of(path: str, mounts: List[Mount]) -> Optional[Mount]:
    """The mount that `path` (absolute, symlinks resolved) is on. The device number that
    stat gives decides, so a mount hidden under a later one is never picked; where no mount
    has that number (a btrfs subvolume reports one of its own), or the path cannot be
    stat'ed, the innermost mount point holding the path."""
    probe = path
    while not os.path.exists(probe) and probe != os.path.dirname(probe):
        probe = os.path.dirname(probe)  # a root not created yet lands where its parent is
    try:
        st = os.stat(probe)
    except OSError:
        return _innermost(path, mounts)
    device = f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
    same = [m for m in mounts if m.device == device]
    if not same:
        return _innermost(path, mounts)
    return _innermost(path, same) or same[-1]  # a bind mount's source may lie elsewhere


def locate(root: str, mountinfo: str = MOUNTINFO) -> Location:
    """Where the dataset root `root` (a path or a URL) lives."""
    scheme, _, rest = root.partition("://")
    if rest and "/" not in scheme:
        if scheme.lower() not in ("file", "local"):
            return Location(False, "url")
        root = urllib.parse.unquote(urllib.parse.urlsplit(root).path)
    path = os.path.realpath(root)  # a symlink onto a network mount is on the network mount
    try:
        with open(mountinfo, "rb") as f:
            mount = mount_of(path, parse_mountinfo(f.read()))
    except OSError:
        return Location(False, "unknown")
    if mount is None:
        return Location(False, "unknown")
    return Location(mount.kind in LOCAL_FILESYSTEMS, mount.kind, mount.mount_point)

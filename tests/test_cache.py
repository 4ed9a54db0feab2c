"""The node cache with real processes: one fetch per file per node, a byte budget that holds
across processes, corrupt entries refetched, reuse after a restart, a full disk; which roots
it caches (local or not), and runs sharing one cache directory."""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import List

import pytest
import torch

from data import synthetic
from data.cache import FOOTER, NodeCache, default_cache_dir
from data.locality import Location, locate
from data.pipeline import open_dataset
from data.volume import Volume
from support.runs import REPO
from support.logs import our_records

# One rank: read every train sample `passes` times through the cache with 2 workers and the
# prefetcher, in the same order as the other rank, so they contend for every file.
RANK = """
import sys
from data.cache import NodeCache
from data.loader import VolumeLoader, eval_batches
from data.pipeline import open_dataset
from data.volume import Volume
root, cache_dir, limit, passes = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
ds = open_dataset(Volume(root), "train", NodeCache(cache_dir, limit), 24, train=False, seed=0)
loader = VolumeLoader(ds, eval_batches(len(ds), 10) * passes, 2, prefetch_factor=2,
                      prefetch_threads=4, prefetch_batches=4)
stats = sum(b.stats for b in loader)
print(int(stats[0]), int(stats[1]), int(stats[3]))
"""


def run_ranks(root: Path, cache_dir: Path, limit: int, ranks: int, log: Path,
              passes: int = 1) -> List[List[int]]:
    """Start `ranks` processes at once; each prints (lookups, hits, bad files)."""
    env = dict(os.environ, GOODPUT_SLOWFS_LOG=str(log), GOODPUT_SLOWFS_LATENCY_MS="5",
               PYTHONPATH=str(REPO))
    procs = [subprocess.Popen([sys.executable, "-c", RANK, f"slow://{root}", str(cache_dir),
                               str(limit), str(passes)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(ranks)]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=240)
        assert proc.returncode == 0, err[-3000:]
        results.append([int(x) for x in out.split()])
    return results


def volume_reads(log: Path) -> Counter:
    return Counter(log.read_text().splitlines()) if log.exists() else Counter()


def object_bytes(cache_dir: Path) -> int:
    """Everything on disk under objects/ and fills/ (fills in progress), as one snapshot:
    the state lock keeps evictions and reservations out while we walk, and a fill renamed
    during the walk counts once (its temporary name ends with its final name)."""
    sizes = {}
    fd = os.open(cache_dir / "state.lock", os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        walks = [*os.walk(cache_dir / "fills"), *os.walk(cache_dir / "objects")]
        for dirpath, _, files in walks:
            for name in files:
                try:
                    size = os.stat(os.path.join(dirpath, name)).st_size
                except FileNotFoundError:
                    continue
                key = name.rsplit("-", 1)[-1]
                sizes[key] = max(sizes.get(key, 0), size)
    finally:
        os.close(fd)
    return sum(sizes.values())


def train_files(root: Path) -> List[str]:
    return sorted(str(p) for p in (root / "train").rglob("*.jpg"))


def test_two_ranks_of_two_workers_fetch_each_file_once_and_reuse_it_after_a_restart(
        tiny_root, tmp_path):
    cache, log = tmp_path / "cache", tmp_path / "reads.log"
    results = run_ranks(tiny_root, cache, 10 ** 9, ranks=2, log=log)
    reads = volume_reads(log)
    assert sorted(reads) == train_files(tiny_root)  # the control: every file was read...
    assert set(reads.values()) == {1}  # ...and only once, by one of the 4 workers + 2 pools
    assert all(lookups == 120 and bad == 0 for lookups, _, bad in results)
    index_files = list((cache / "index").iterdir())
    index_mtime = [p.stat().st_mtime_ns for p in index_files]

    # A restart: new processes, same cache directory. Nothing is fetched or listed again.
    log.unlink()
    (lookups, hits, _), = run_ranks(tiny_root, cache, 10 ** 9, ranks=1, log=log)
    assert not volume_reads(log)
    assert hits == lookups == 120
    assert [p.stat().st_mtime_ns for p in index_files] == index_mtime


def test_the_byte_budget_holds_across_processes(tiny_root, tmp_path):
    cache, log = tmp_path / "cache", tmp_path / "reads.log"
    dataset_bytes = sum(os.path.getsize(f) for f in train_files(tiny_root))
    limit = dataset_bytes // 2
    peak = [0]
    done = threading.Event()

    def watch() -> None:  # samples the disk while the ranks fill and evict
        while not done.is_set():
            if (cache / "objects").is_dir():
                peak[0] = max(peak[0], object_bytes(cache))
            time.sleep(0.001)  # let the ranks take the lock between samples

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        results = run_ranks(tiny_root, cache, limit, ranks=2, log=log, passes=2)
    finally:
        done.set()
        watcher.join()
    assert all(lookups == 240 for lookups, _, _ in results)  # nothing lost to eviction
    assert sum(volume_reads(log).values()) > 120  # the control: the budget forced refetches
    assert 0 < peak[0] <= limit
    assert object_bytes(cache) == NodeCache(cache, limit).usage_bytes() <= limit


def test_a_truncated_or_corrupt_cache_file_is_refetched_never_served(tmp_path, caplog):
    cache = NodeCache(tmp_path / "cache", 10 ** 6)
    fetches = []

    def fetch() -> bytes:
        fetches.append(1)
        return b"payload " * 100

    data, lookup = cache.get("k" * 40, fetch)
    assert not lookup.hit and cache.get("k" * 40, fetch)[1].hit and len(fetches) == 1
    path = cache._object("k" * 40)
    for damage in ("truncate", "flip"):
        blob = path.read_bytes()
        if damage == "truncate":
            path.write_bytes(blob[:len(blob) // 2])
        else:
            path.write_bytes(blob[:10] + bytes([blob[10] ^ 1]) + blob[11:])
        with caplog.at_level(logging.WARNING, logger="data.cache"):
            again, lookup = cache.get("k" * 40, fetch)
        assert again == data and not lookup.hit
        assert "truncated or corrupt" in caplog.text
        caplog.clear()
    assert len(fetches) == 3
    assert cache.usage_bytes() == len(data) + FOOTER.size == path.stat().st_size


@pytest.fixture
def tmpfs(tmp_path):
    """A real, tiny filesystem; mounting needs root (CI runs as root)."""
    mounts = []

    def mount(size: str) -> Path:
        path = tmp_path / f"tmpfs-{size}"
        path.mkdir()
        result = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs",
                                 str(path)], capture_output=True, text=True)
        if result.returncode:
            pytest.skip(f"cannot mount a tmpfs here: {result.stderr.strip()}")
        mounts.append(path)
        return path

    yield mount
    for path in mounts:
        subprocess.run(["umount", str(path)], check=False)


def test_a_full_cache_disk_evicts_then_reads_through_and_loses_nothing(tmp_path, tmpfs,
                                                                       caplog):
    root = synthetic.generate(tmp_path / "big", 20, 10, 160, workers=1)  # ~5 KB files
    direct = open_dataset(Volume(str(root)), "train", None, 32, train=True, seed=0)
    expected = [direct[(0, i)].image for i in range(len(direct))]
    for size, message in (("16k", "evicting least-recently-used"), ("4k", "even after eviction")):
        cache = NodeCache(tmpfs(size), 10 ** 9)  # the budget claims far more than the disk
        ds = open_dataset(Volume(str(root)), "train", cache, 32, train=True, seed=0)
        with caplog.at_level(logging.WARNING, logger="data.cache"):
            for _ in range(2):
                got = [ds[(0, i)].image for i in range(len(ds))]
                assert all(torch.equal(a, b) for a, b in zip(got, expected))
        assert message in caplog.text
        caplog.clear()


# ---- the node-wide default cache: the locality rule, and runs sharing one directory ----

def mountinfo(tmp_path: Path, *mounts: tuple) -> str:
    """A /proc/self/mountinfo-format file of (device, mount point, type) lines, in order."""
    path = tmp_path / "mountinfo"
    path.write_bytes(b"".join(
        b"%d 1 %s / %s rw,relatime shared:1 - %s src rw\n" % (
            n, dev.encode(), point.replace(" ", "\\040").encode(), kind.encode())
        for n, (dev, point, kind) in enumerate(mounts, 20)))
    return str(path)


def device(path: Path) -> str:
    st = os.stat(path)
    return f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"


def test_a_root_is_local_only_on_a_local_filesystem_by_its_device(tmp_path):
    here = tmp_path / "my data"
    (here / "hidden").mkdir(parents=True)
    dev = device(here)
    # A FUSE mount by the device number stat gives; the escaped space is read back.
    fuse = mountinfo(tmp_path, ("8:1", "/", "ext4"), (dev, str(here), "fuse.rclone"))
    assert locate(str(here), fuse) == Location(False, "fuse.rclone", str(here))
    assert locate(f"file://{here}/train", fuse).kind == "fuse.rclone"  # not created yet
    # An NFS mount at here/hidden that a later local mount on `here` hides: the path's own
    # device decides, not the longest mount point.
    hidden = mountinfo(tmp_path, ("0:99", str(here / "hidden"), "nfs4"), (dev, str(here), "xfs"))
    assert locate(str(here / "hidden"), hidden) == Location(True, "xfs", str(here))
    # Types nobody listed count as remote; so do URLs and a missing mount table.
    assert not locate(str(here), mountinfo(tmp_path, (dev, "/", "squashfs"))).local
    assert locate("s3://bucket/imagenet", fuse) == Location(False, "url")
    assert locate("slow:///data", fuse).kind == "url"
    assert locate(str(here), str(tmp_path / "absent")) == Location(False, "unknown")


@pytest.mark.parametrize("odd", [b"20 1 0:5 / /mnt/a\\777b rw - nfs4 s rw",  # no such byte
                                 b"20 1 0:5 / /mnt/a\\400 rw - nfs4 s rw",
                                 b"20 1 \xff:\xfe / /mnt rw - nfs4 s rw",  # not UTF-8
                                 b"20 1 0:5 / /mnt/\xff\\ rw - nfs4 s rw",
                                 b"-", b"a b c d e f -", b"\x00" * 64, b""])
def test_odd_mountinfo_lines_are_read_around(tmp_path, odd):
    here = tmp_path / "data"
    here.mkdir()
    table = tmp_path / "mountinfo"
    table.write_bytes(odd + b"\n" + Path(mountinfo(tmp_path, (device(here), "/", "xfs")))
                      .read_bytes())
    assert locate(str(here), str(table)) == Location(True, "xfs", "/")


@pytest.mark.skipif(not os.path.ismount("/dev/shm"), reason="needs /dev/shm as a mount")
def test_a_symlink_is_judged_by_the_filesystem_it_leads_to(tmp_path):
    target = Path(tempfile.mkdtemp(dir="/dev/shm"))
    try:
        (tmp_path / "link").symlink_to(target)
        table = mountinfo(tmp_path, (device(tmp_path), "/", "ext4"),
                          (device(target), "/dev/shm", "nfs"))
        assert locate(str(tmp_path / "link"), table) == Location(False, "nfs", "/dev/shm")
        assert locate(str(tmp_path), table).local
    finally:
        shutil.rmtree(target)


def test_the_default_cache_dir_follows_xdg(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default_cache_dir() == str(tmp_path / "goodput-trainer")
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/dir")  # ignored, as the XDG rule says
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_cache_dir() == str(tmp_path / "home" / ".cache" / "goodput-trainer")


def test_a_fill_that_another_hosts_recount_reaped_is_served_uncached(tmp_path, monkeypatch):
    """A process on another host (or PID namespace) sharing the directory sees this fill's
    pid as dead and removes it mid-write: the read still succeeds, and the ledger stays
    exact."""
    cache, other = NodeCache(tmp_path / "c", 10 ** 6), NodeCache(tmp_path / "c", 10 ** 6)
    reserve = NodeCache._reserve

    def reserve_then_reaped(self, size, tmp, candidates=()):
        booked = reserve(self, size, tmp, candidates)
        with monkeypatch.context() as m:
            m.setattr("data.cache.pid_alive", lambda pid: False)
            other.reconcile()
        return booked

    monkeypatch.setattr(NodeCache, "_reserve", reserve_then_reaped)
    data, lookup = cache.get("ab" * 20, lambda: b"x" * 1000)
    assert (bytes(data), lookup.hit) == (b"x" * 1000, False)
    assert cache.usage_bytes() == object_bytes(tmp_path / "c") == 0


def test_two_stores_with_the_same_paths_never_share_a_cache_entry_or_an_index(tiny_root,
                                                                               tmp_path):
    """`memory://<tiny_root>` holds the same names and sizes as the local `tiny_root` with
    other bytes: one shared cache must serve each store its own files and its own index."""
    import fsspec

    memory = fsspec.filesystem("memory")
    flipped = {}
    for path in (tiny_root / "train").rglob("*.jpg"):
        path = str(path.relative_to(tiny_root))
        blob = bytearray((tiny_root / path).read_bytes())
        blob[len(blob) // 2] ^= 0xFF  # same size, still starts like a JPEG
        memory.pipe_file(f"{tiny_root}/{path}", bytes(blob))
        flipped[path] = bytes(blob)
    try:
        cache = NodeCache(tmp_path / "shared", 10 ** 9)
        local = open_dataset(Volume(str(tiny_root)), "train", cache, 24, train=False, seed=0)
        remote = open_dataset(Volume(f"memory://{tiny_root}"), "train", cache, 24,
                              train=False, seed=0)
        assert local.index.url != remote.index.url
        assert len(list((tmp_path / "shared" / "index").iterdir())) == 2
        for i in range(len(local)):
            name = local.index.name(i)
            assert bytes(local.read_bytes(i)[0]) == (tiny_root / name).read_bytes()
            assert bytes(remote.read_bytes(i)[0]) == flipped[name]
    finally:
        memory.rm(str(tiny_root), recursive=True)


@pytest.mark.parametrize("smaller", [10 ** 3, 4 * 10 ** 3])
def test_a_run_whose_budget_is_below_what_the_shared_cache_holds_says_so_once(
        tmp_path, caplog, smaller):
    """Runs share the node's cache directory; one with a smaller data.cache_limit_gb evicts
    the others' files down to its own budget, so they fetch them again: a warning line."""
    big = NodeCache(tmp_path / "c", 10 ** 6)
    for i in range(5):
        big.get(f"{i:02d}" * 20, lambda: b"x" * 1000)
    with caplog.at_level(logging.WARNING, logger="data.cache"):
        NodeCache(tmp_path / "c", 10 ** 6)  # the same budget: nothing to say
        assert not our_records(caplog)
        NodeCache(tmp_path / "c", smaller)
    lines = [r.getMessage() for r in our_records(caplog)]
    assert len(lines) == 1 and "over this run's data.cache_limit_gb" in lines[0], lines
    assert "same data.cache_limit_gb" in lines[0]


# ---- process starts: the ledger recounted once per node, and only when it must be ----

# One process on the cache at argv[1]: prints "ready" once imported, waits for a line on
# stdin, then starts (logging the cache's records) and acts as argv[2] says: "start" only;
# "fill" or "change": one fill, stopping (for the kill) after its reservation, or inside a
# change to the ledger with the state lock held; "loop": fills until killed.
PROCESS = """
import itertools, logging, os, sys
from data.cache import NodeCache
logging.basicConfig(level=logging.INFO, format="%(name)s %(message)s")
root, act = sys.argv[1], sys.argv[2]
print("ready", flush=True)
sys.stdin.readline()
cache = NodeCache(root, 10 ** 6)

def stop_here():
    print("stopped", flush=True)
    sys.stdin.read()  # until killed

def wrap(name):
    method = getattr(NodeCache, name)
    def stopping(self, *args):
        method(self, *args)
        stop_here()
    setattr(NodeCache, name, stopping)

if act in ("fill", "change"):
    wrap("_reserve" if act == "fill" else "_add_usage")
    cache.ensure("ab" * 20, lambda: b"x" * 1000)
elif act == "loop":
    for i in itertools.count():
        cache.ensure(f"{os.getpid()}k{i}", lambda: b"y" * (100 + i % 50))
        print(i, flush=True)
"""


def start_processes(cache: Path, act: str, count: int) -> List[subprocess.Popen]:
    """`count` processes, started at once once all are imported."""
    procs = [subprocess.Popen([sys.executable, "-c", PROCESS, str(cache), act], text=True,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, env=dict(os.environ, PYTHONPATH=str(REPO)))
             for _ in range(count)]
    for proc in procs:
        assert proc.stdout.readline() == "ready\n", proc.communicate()[1][-2000:]
    for proc in procs:
        proc.stdin.write("go\n")
        proc.stdin.flush()
    return procs


def recounts(procs: List[subprocess.Popen]) -> int:
    """How many of these (finished) processes recounted the ledger, by their log."""
    count = 0
    for proc in procs:
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err[-2000:]
        count += sum(line.startswith("data.cache recounted") for line in err.splitlines())
    return count


def kill(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL


def ledger_matches_disk(cache: Path) -> bool:
    return NodeCache(cache, 10 ** 6).usage_bytes() == object_bytes(cache)


def test_processes_starting_at_once_recount_the_ledger_once_and_only_when_it_is_untrusted(
        tmp_path):
    """Every rank of a node starts at once after a restart; a recount of a big cache takes
    seconds under the lock, so paid by each rank in turn it was paid 8 times per node."""
    cache = tmp_path / "c"
    filled = NodeCache(cache, 10 ** 6)
    for i in range(50):
        filled.get(f"{i:02d}" * 20, lambda: b"z" * 500)
    assert recounts(start_processes(cache, "start", 4)) == 0  # a trusted ledger: none
    stopped, = start_processes(cache, "change", 1)
    assert stopped.stdout.readline() == "stopped\n"
    kill(stopped)  # in the middle of a change to the ledger: it cannot be trusted
    assert recounts(start_processes(cache, "start", 4)) == 1  # once for the node
    assert recounts(start_processes(cache, "start", 4)) == 0
    assert ledger_matches_disk(cache) and not list((cache / "fills").iterdir())


@pytest.mark.parametrize("where", ["fill", "change"])
def test_a_process_killed_mid_fill_leaves_the_next_start_a_true_ledger(tmp_path, where):
    """Killed after booking its fill (the usual instant: the write takes longer than the
    booking), or with the state lock held in the middle of the booking."""
    cache = tmp_path / "c"
    NodeCache(cache, 10 ** 6).get("cd" * 20, lambda: b"w" * 700)
    stopped, = start_processes(cache, where, 1)
    assert stopped.stdout.readline() == "stopped\n"
    kill(stopped)
    assert list((cache / "fills").iterdir())  # the control: its fill is left behind
    # A fill left outside the lock is given back without a recount.
    assert recounts(start_processes(cache, "start", 1)) == (where == "change")
    assert not list((cache / "fills").iterdir())
    assert ledger_matches_disk(cache)
    assert object_bytes(cache) == 700 + FOOTER.size


def test_processes_killed_while_filling_at_once_leave_a_true_ledger(tmp_path):
    cache = tmp_path / "c"
    procs = start_processes(cache, "loop", 3)
    for n, proc in enumerate(procs):
        for _ in range(20 + 7 * n):  # each killed after a different number of fills
            assert proc.stdout.readline()
    for proc in procs:
        kill(proc)
    recounts(start_processes(cache, "start", 1))
    assert not list((cache / "fills").iterdir())
    assert ledger_matches_disk(cache) and object_bytes(cache) > 0


def test_the_first_start_after_a_reboot_recounts(tmp_path, monkeypatch, caplog):
    """Writes to the ledger still in the page cache at a power loss are lost, so a start
    trusts only a ledger written since this boot; a host that names no boot recounts at
    every start."""
    NodeCache(tmp_path / "c", 10 ** 6).get("ef" * 20, lambda: b"v" * 300)

    def starts_recounting() -> List[str]:
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="data.cache"):
            NodeCache(tmp_path / "c", 10 ** 6)
        return [r.getMessage() for r in our_records(caplog) if "recounted" in r.getMessage()]

    assert starts_recounting() == []  # the control: the same boot
    monkeypatch.setattr("data.cache.boot_id", lambda: b"0d6c2a8e-another-boot")
    assert ["written before this boot" in m for m in starts_recounting()] == [True]
    assert starts_recounting() == []
    monkeypatch.setattr("data.cache.boot_id", lambda: None)
    assert len(starts_recounting()) == len(starts_recounting()) == 1
    assert ledger_matches_disk(tmp_path / "c")


def test_hostile_entries_in_fills_and_a_garbage_ledger_neither_stop_a_start_nor_reach_out(
        tmp_path):
    """What is no fill of ours in fills/ (a directory, a link out of the cache, a pid no
    process can have) is left alone and booked nothing; a garbage ledger is recounted."""
    root, outside = tmp_path / "c", tmp_path / "precious"
    outside.write_bytes(b"keep me")
    NodeCache(root, 10 ** 6).get("ab" * 20, lambda: b"v" * 300)
    fills = root / "fills"
    (fills / ".tmp-4194000-1-500-dd").mkdir()  # a dead pid's name, on a directory
    (fills / ".tmp-4194001-1-500-ee").symlink_to(outside)
    (fills / ".tmp-99999999999999999999-1-500-ff").write_bytes(b"x")
    (fills / ".tmp-0-1-500-00").write_bytes(b"x")  # kill(0) is our own process group
    for usage in (None, b"9" * 30 + b" x clean\n" + b"y" * 1000):
        if usage is not None:
            (root / "usage").write_bytes(usage)
        assert NodeCache(root, 10 ** 6).usage_bytes() == 300 + FOOTER.size
    assert outside.read_bytes() == b"keep me"


def test_a_fill_whose_pid_a_later_process_took_is_settled_as_dead(tmp_path):
    """A fill left by a dead writer whose pid another process now has: that process started
    after the fill was written, so it cannot be the writer; its booking is given back."""
    root = tmp_path / "c"
    NodeCache(root, 10 ** 6).get("ab" * 20, lambda: b"v" * 300)
    stranger = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                                stdin=subprocess.PIPE)
    try:
        fill = root / "fills" / f".tmp-{stranger.pid}-1-500-{'cd' * 20}"
        fill.write_bytes(b"x" * 100)
        hour_ago = time.time() - 3600
        os.utime(fill, (hour_ago, hour_ago))
        (root / "usage").unlink()  # a recount: the booking of a live fill would count
        assert NodeCache(root, 10 ** 6).usage_bytes() == 300 + FOOTER.size
        assert not fill.exists()
    finally:
        stranger.stdin.close()
        stranger.wait()

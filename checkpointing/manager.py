"""CheckpointManager: `save(step, state)` -> `PendingSave`, `wait()`, `load_latest(state)`.

A save blocks the training loop only while the state is staged: one copy into CPU buffers
allocated at the first save and reused (so parameters, BatchNorm buffers and optimizer state
mutated right after `save` returns do not leak in). Writing, the upload from the local
staging tier, the per-rank commit markers, the rename to `step_X` and retention run in the
background, one save at a time. See `checkpointing.commit` for what "complete" means.
"""

from __future__ import annotations

import errno
import json
import logging
import shutil
import sys
import tempfile
import threading
import time
import uuid
import warnings
from concurrent.futures import Future
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Mapping, NamedTuple, Optional, Tuple

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

from checkpointing import commit
from checkpointing.checksums import WRITE_ALGORITHM
from checkpointing.commit import FileRecord
from checkpointing.options import MIN_KEEP_LAST, AsyncMode, CheckpointFormat
from checkpointing.safe_load import SafeLoadPlanner, forget_parsed, safe_reader
from checkpointing.staging import WarmStager
from checkpointing.storage import Store
from checkpointing.verify import listed_files
from checkpointing.writer import Writer, take_records
from common.distributed import broadcast_object, every_rank, smallest
from common.processes import stop_signals_kept_from_helpers
from common.files import CHUNK
from common.redact import one_line

log = logging.getLogger(__name__)

ASYNC_MODES = tuple(mode.value for mode in AsyncMode)
FORMATS = tuple(f.value for f in CheckpointFormat)  # checkpointing.writer: DCP's, or bare bytes
NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


# What DCP says whenever it is asked for a single-process save or load (no_dist), which is
# our choice for one rank, not a sign that distributed set-up went wrong.
SINGLE_PROCESS_WARNING = (r"torch\.distributed is disabled, unavailable or uninitialized, "
                          r"assuming the intent is to (save|load) in a single process\.")


# The same as a -W option: what multiprocessing passes on to the processes it spawns
# (`checkpoint.async_mode=process` saves in one). A literal prefix of both messages.
SINGLE_PROCESS_OPTION = ("ignore:torch.distributed is disabled, unavailable or uninitialized, "
                         "assuming the intent is to:UserWarning")


def quiet_single_process_dcp() -> None:
    """Silence that one warning (and no other) for the single-process DCP calls we make,
    here and in the saver process DCP spawns; repeated calls keep a single filter."""
    warnings.filterwarnings("ignore", message=SINGLE_PROCESS_WARNING, category=UserWarning)
    if SINGLE_PROCESS_OPTION not in sys.warnoptions:
        sys.warnoptions.append(SINGLE_PROCESS_OPTION)


class CheckpointError(RuntimeError):
    """A checkpoint could not be saved or loaded; the message says which and why."""


@dataclass(frozen=True)
class CheckpointOptions:
    dir: str  # the durable tier: a mounted path or an fsspec URL
    staging_dir: Optional[str] = None  # local NVMe tier; None = write straight to `dir`
    async_mode: str = "thread"
    keep_last: int = 3
    commit_timeout_s: float = 600.0
    # fsspec's options for `dir` (an S3-compatible endpoint, credentials, ...)
    storage_options: Mapping[str, Any] = field(default_factory=dict)
    format: str = "dcp"

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise ValueError(f"checkpoint.format={self.format!r}: use one of "
                             f"{', '.join(FORMATS)}")
        if self.async_mode not in ASYNC_MODES:
            raise ValueError(f"checkpoint.async_mode={self.async_mode!r}: use one of "
                             f"{', '.join(ASYNC_MODES)}")
        if self.keep_last < MIN_KEEP_LAST:
            raise ValueError(f"checkpoint.keep_last={self.keep_last}: keep at least "
                             f"{MIN_KEEP_LAST}, so a checkpoint damaged after its commit still "
                             f"has a fallback")


def _causes(err: BaseException) -> Iterator[BaseException]:
    """`err`, the exceptions it wraps (DCP gathers each rank's into one) and their causes."""
    todo, seen = [err], set()
    while todo:
        e = todo.pop(0)
        if id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        if isinstance(e, CheckpointException):  # its str() holds every rank's traceback
            todo.extend(f[0] if isinstance(f, tuple) else f for f in e.failures.values())
        todo.extend(c for c in (e.__cause__, e.__context__) if c is not None)


def dcp_cause(err: BaseException) -> BaseException:
    """What went wrong, without DCP's tracebacks: the innermost error that is not DCP's
    wrapper (whose str() holds every rank's traceback)."""
    return next((e for e in _causes(err) if not isinstance(e, CheckpointException)), err)


def _free_bytes(where: str) -> float:
    """Free space at a local directory; infinite when unknown (a URL, or it is gone)."""
    try:
        return shutil.disk_usage(where).free
    except (OSError, ValueError):
        return float("inf")


def _megabytes(n: float) -> str:
    return f"{n / 1e6:.1f} MB"


class Loaded(NamedTuple):
    """What a load restored: the checkpoint's step, and the world size that saved it."""

    step: int
    world_size: int


@dataclass(frozen=True)
class SaveResult:
    """How one save ended: committed, in `seconds` from `save` to the commit, or failed
    with `error` (one line) saying why."""

    step: int
    committed: bool
    seconds: float = 0.0
    error: str = ""


class PendingSave:
    """One save, as `CheckpointManager.save` hands it back: its step, the seconds the caller
    was blocked, and once it landed its `SaveResult`. A save that commits lands from the
    thread that commits it; one that fails lands in the manager's next `wait()` (the next
    save, a `wait`, `close`), which cleans up after it and says why. Each save has its own,
    so its outcome is never another save's."""

    def __init__(self, step: int, wait: Callable[[], bool]) -> None:
        self.step = step
        self.stall_seconds = 0.0  # set before `save` returns it
        self._wait = wait
        self._landed = threading.Event()
        self._result: Optional[SaveResult] = None

    def done(self) -> bool:
        """Whether it landed (committed or failed); never blocks."""
        return self._landed.is_set()

    def result(self) -> SaveResult:
        """How it ended, waiting (on the manager's in-flight save) until it has."""
        if not self._landed.is_set():
            self._wait()
        return self._result

    def _land(self, result: SaveResult) -> None:
        self._result = result
        self._landed.set()


class CheckpointManager:
    def __init__(self, options: CheckpointOptions, rank: int = 0, world_size: int = 1,
                 process_group: Optional[dist.ProcessGroup] = None,
                 fault_hook: Callable[[str, int], None] = lambda phase, step: None,
                 local_rank: int = 0, node_rank: int = 0) -> None:
        self.options, self.rank, self.world_size = options, rank, world_size
        self.local_rank = local_rank  # rank within this node: 0 cleans the node's staging
        self.node_rank = node_rank  # torchrun's agent (node): ranks of one share its staging
        self.group = process_group
        self.fault_hook = fault_hook  # tests and demos inject crashes at named phases
        self.remote = Store(options.dir, options.storage_options)
        staging = options.staging_dir
        if staging is None and not self.remote.is_local:
            staging = tempfile.mkdtemp(prefix="goodput-staging-")
        self.staging = Path(staging).resolve() if staging else None
        self.local = Store(str(self.staging)) if self.staging else None
        self.attempt = self._agree_on_attempt_id()
        self._pending: Optional[threading.Thread] = None
        # the failure of the last save and the directory it was writing to
        self._pending_error: Optional[Tuple[BaseException, str]] = None
        self._in_flight: Optional[PendingSave] = None  # the newest save begun
        self._pending_planner: Optional[DefaultSavePlanner] = None
        # for the error lines: the newest step committed or loaded by this process
        self._newest_complete: Optional[int] = None
        self._verified: set = set()  # (store url, step) whose checksums were verified
        self.failed_uploads = 0  # in a row, to an object store that is unreachable
        self._stager = WarmStager(share_memory=options.async_mode == "process")

    # ---- collectives (a dedicated group, so they never interleave with training's) ----

    def _broadcast(self, obj: Any) -> Any:
        return obj if self.group is None else broadcast_object(obj, self.group)

    def _all_true(self, flag: bool) -> bool:
        return flag if self.group is None else every_rank(flag, group=self.group)

    def _agree_on_attempt_id(self) -> str:
        return self._broadcast(f"{int(time.time())}-{uuid.uuid4().hex[:8]}")

    def _dcp_kwargs(self) -> Dict[str, Any]:
        # One rank needs no collectives: DCP's would pickle every save's plan and metadata
        # through the group and back (0.07 s a save for ResNet-50 + AdamW on 2 CPU cores)
        if self.group is None or self.world_size == 1:
            quiet_single_process_dcp()
            return {"no_dist": True}
        return {"process_group": self.group}

    def check_storage(self) -> None:
        """Raise CheckpointError, on every rank, unless each tier can be written: at start,
        rather than at the first save with every step before it lost. A collective: rank 0
        checks `checkpoint.dir` (shared), every rank its node's staging directory."""
        tiers = [("checkpoint.dir", self.remote)] if self.rank == 0 else []
        if self.local:
            tiers.append(("checkpoint.staging_dir", self.local))
        problem = None
        for key, store in tiers:
            try:
                store.check_writable()
            except Exception as err:  # an object store's client has errors of its own
                problem = (f"{key}={store.url} is not a writable directory ({one_line(err)}): "
                           f"point {key} at one this process can write")
                break
        if not self._all_true(problem is None):
            raise CheckpointError(problem or "checkpoint storage is not writable on another "
                                             "rank: see its error")

    # ---- save ----

    def save(self, step: int, state: Dict[str, Any]) -> PendingSave:
        """Snapshot `state` (Stateful objects and tensors) as checkpoint `step`.

        Returns once the snapshot is staged (the rest happens in the background): the save's
        handle, with the seconds the caller was blocked, waiting for the previous save
        included, and later how the save ended.
        """
        start = time.perf_counter()
        self.wait()
        partial = commit.partial_dir_name(step, self.attempt)
        target = (self.staging / partial) if self.staging else Path(self.remote.path(partial))
        target.mkdir(parents=True, exist_ok=True)
        writer = Writer(str(target), self.rank, raw=self.options.format == "raw")
        planner = DefaultSavePlanner()
        handle = PendingSave(step, self.wait)
        self._pending_planner = planner
        if self.options.async_mode == "off":
            self._in_flight = handle
            # A failure is reported like a background one: by the next wait() or close().
            try:
                dcp.save(state, storage_writer=writer, planner=planner, **self._dcp_kwargs())
            except (Exception, CheckpointException) as err:  # the latter is a BaseException
                self._pending_error = (err, str(target.parent))
            else:
                self._commit_or_record(handle, target, start)
            handle.stall_seconds = time.perf_counter() - start
            return handle
        kind = (AsyncCheckpointerType.PROCESS if self.options.async_mode == "process"
                else AsyncCheckpointerType.THREAD)
        with (stop_signals_kept_from_helpers() if kind == AsyncCheckpointerType.PROCESS
              else nullcontext()):
            future = dcp.async_save(state, storage_writer=writer, planner=planner,
                                    async_stager=self._stager, async_checkpointer_type=kind,
                                    **self._dcp_kwargs())
        handle.stall_seconds = time.perf_counter() - start
        self._in_flight = handle
        self._pending = threading.Thread(target=self._finish_in_background,
                                         args=(future, handle, target, start),
                                         name=f"checkpoint-{step}", daemon=True)
        self._pending.start()
        return handle

    def _finish_in_background(self, future: Future, handle: PendingSave, target: Path,
                              start: float) -> None:
        try:
            future.result()
        except BaseException as err:  # reported by wait(); never silently lost
            self._pending_error = (err, str(target.parent))
            return
        self._commit_or_record(handle, target, start)

    def _commit_or_record(self, handle: PendingSave, target: Path, start: float) -> None:
        try:
            self._commit(handle.step, target)
            handle._land(SaveResult(handle.step, True, seconds=time.perf_counter() - start))
        except BaseException as err:  # the upload and markers go to checkpoint.dir
            self._pending_error = (err, self.remote.url)

    def _remote_dir(self, step: int) -> str:
        """Where a save uploads: a partial directory to rename, or on an object store (no
        rename) `step_X` itself, which only its markers, written last, make complete."""
        if self.remote.renames:
            return commit.partial_dir_name(step, self.attempt)
        return commit.step_dir_name(step)

    def _commit(self, step: int, target: Path) -> None:
        """Upload this rank's files, write its marker; rank 0 renames once all are in."""
        self.fault_hook("written", step)
        partial = commit.partial_dir_name(step, self.attempt)
        records = self._written_records(target)
        mine = [target / name for name in sorted(records)]
        remote_dir = self._remote_dir(step)
        if self.staging:
            self.remote.makedirs(self.remote.path(remote_dir))
            for p in mine:
                self.remote.put(p, self.remote.path(remote_dir, p.name))
                self.fault_hook("uploading", step)
            self._check_upload(remote_dir, records)
            commit.write_marker(self.local, partial, step, self.rank,
                                self.world_size, records, self.attempt)
        self.fault_hook("uploaded", step)
        commit.write_marker(self.remote, remote_dir, step, self.rank, self.world_size, records,
                            self.attempt)
        if self.failed_uploads:
            log.info("checkpoint.dir %s is reachable again: step %d uploaded after %d failed "
                     "upload(s)", self.remote.url, step, self.failed_uploads)
            self.failed_uploads = 0
        if self.rank == 0:
            markers = self._wait_for_markers(remote_dir, step)
            self.fault_hook("committing", step)
            if self.remote.renames:
                self._rename_into_place(self.remote, partial, step)
            if self.local:
                self._rename_into_place(self.local, partial, step)
            self._trust_what_was_written(step, markers)
            self.apply_retention(step)
        elif self.local and self.local_rank == 0:
            self._clean_local_partials(step)
        self._newest_complete = step

    def _check_upload(self, remote_dir: str, records: Dict[str, FileRecord]) -> None:
        """Read back what this rank uploaded and check it against the checksums taken as it
        was written, before its marker vouches for it. The durable copy is so verified once,
        by the ranks that wrote it, each its own share, rather than by rank 0 alone at every
        save's retention (a whole 1 B-parameter checkpoint, 12 GB, downloaded each time)."""
        names = sorted(records)
        failure = commit.first_mismatch(self.remote, remote_dir, records, names)
        if failure is not None:
            raise CheckpointError(f"the upload to {self.remote.url_of(remote_dir)} failed "
                                  f"its check: {commit.describe_mismatch(names, failure)}")

    def _trust_what_was_written(self, step: int, markers: Dict[str, bytes]) -> None:
        """Every rank's checksums came from the bytes as they were written and fsynced, and
        each rank read back what it uploaded (`_check_upload`): retention need not read them
        again. It must still find every rank's files in each tier: on a job of several
        nodes, this node's staging holds only its own ranks' (and retention drops that
        incomplete copy). `markers`: the remote's, as the wait for them read them."""
        for store, read in [(self.remote, markers)] + ([(self.local, {})] if self.local else []):
            try:
                commit.checked_layout(store, commit.step_dir_name(step), step, read)
            except commit.Incomplete:
                continue
            self._verified.add((store.url, step))

    def _written_records(self, target: Path) -> Dict[str, FileRecord]:
        """This rank's files in `target` (rank 0's include `.metadata`), with the checksums
        its writer took while writing them."""
        records = {}
        for name, (size, checksum) in take_records(target, self.rank).items():
            # a byte that reached the file by another way than the hashing stream would
            # change its size
            if (target / name).stat().st_size != size:
                raise CheckpointError(f"{target / name} is not the {size} bytes its writer "
                                      f"checksummed")
            records[name] = FileRecord(size, checksum, WRITE_ALGORITHM)
        return records

    def _wait_for_markers(self, directory: str, step: int) -> Dict[str, bytes]:
        """Until every rank's marker of this attempt is in `directory`. On an object store
        `step_X` may hold a dead attempt's markers: those of ranks past this world size are
        removed (they would make it incomplete for good), the others wait to be replaced.
        Returns the markers it read, by name (an object store's: each read once a save)."""
        deadline = time.monotonic() + self.options.commit_timeout_s
        ours: Dict[int, Optional[bytes]] = {}
        while len(ours) < self.world_size:
            for rank in set(commit.markers_present(self.remote, directory)) - set(ours):
                if self.remote.renames:  # a partial directory is this attempt's own
                    ours[rank] = None
                elif rank >= self.world_size:
                    self.remote.remove(self.remote.path(directory, commit.marker_name(rank)))
                elif (body := self._our_marker(directory, rank)) is not None:
                    ours[rank] = body
            if len(ours) == self.world_size:
                return {commit.marker_name(r): b for r, b in ours.items() if b is not None}
            if time.monotonic() > deadline:
                raise CheckpointError(
                    f"checkpoint step {step}: not every rank committed within "
                    f"{self.options.commit_timeout_s:.0f}s; it stays partial and is ignored")
            time.sleep(0.05 if self.remote.is_local else 0.5)  # an object store bills LISTs
        return {}

    def _our_marker(self, directory: str, rank: int) -> Optional[bytes]:
        """Rank `rank`'s marker in `directory` when this save attempt wrote it, else None
        (gone, not JSON, or a dead attempt's)."""
        try:
            body = self.remote.read_bytes(self.remote.path(directory, commit.marker_name(rank)))
            return body if json.loads(body).get("attempt") == self.attempt else None
        except (OSError, ValueError, AttributeError):
            return None

    def _rename_into_place(self, store: Store, partial: str, step: int) -> None:
        final = commit.step_dir_name(step)
        if store.exists(store.path(final)):
            # A step_X that failed verification earlier (we resumed from an older one):
            # move it aside so the name only ever holds a complete checkpoint.
            store.rename(store.path(final), store.path(f".{final}.replaced-{self.attempt}"))
        store.rename(store.path(partial), store.path(final))

    def _clean_local_partials(self, before: Optional[int] = None) -> None:
        """Remove this node's staging partials, but those of this attempt's saves from
        step `before` on (None: remove all).

        On every node but rank 0's nothing else removes them (rank 0 renames and retains its
        own node's only). Race-free without a lock: DCP's save is a collective, so once this
        rank's save of `before` is written, every rank has finished the save before it; and
        partials of other attempts are leftovers of dead trainers (the run lock keeps out
        live ones).
        """
        for name in self.local.listdir():
            match = commit.PARTIAL_DIR.match(name)
            if match and not (before is not None and name.endswith(f"-{self.attempt}")
                              and int(match.group(1)) >= before):
                self.local.remove(self.local.path(name))

    def wait(self, report: bool = True) -> bool:
        """Block until the in-flight save (if any) has landed. False if it failed: then its
        `PendingSave` says why, and with `report` one error line does too."""
        if self._pending is not None:
            self._pending.join()
            self._pending = None
        failure, self._pending_error = self._pending_error, None
        if failure is None:
            return True
        handle, (error, where) = self._in_flight, failure
        step = handle.step
        if where == self.remote.url and not self.remote.is_local:
            self._discard(step, uploading=True)
            handle._land(SaveResult(step, False, error=one_line(dcp_cause(error))))
            self._report_failed_upload(report)
            return False
        full = _free_bytes(where) < max(self._checkpoint_bytes(), CHUNK)  # before _discard
        self._discard(step)
        handle._land(SaveResult(step, False, error=self._describe(error, where, full)))
        if report:
            log.error("checkpoint at step %d failed: %s (the newest complete one is %s)",
                      step, handle.result().error, self._newest_or_none())
        return False

    def _newest_or_none(self) -> Any:
        return self._newest_complete if self._newest_complete is not None else "none"

    def _report_failed_upload(self, report: bool) -> None:
        """An object store that fails (gone, unreachable, refusing) stops no training: one
        warning when it starts failing; each next checkpoint tries the upload again."""
        self.failed_uploads += 1
        if report and self.failed_uploads == 1:
            log.warning("checkpoint at step %d could not be uploaded to checkpoint.dir %s (%s): "
                        "training goes on, and each next checkpoint tries the upload again "
                        "(the newest complete one is %s)", self._in_flight.step, self.remote.url,
                        self._in_flight.result().error, self._newest_or_none())
        elif report:
            log.info("checkpoint at step %d could not be uploaded either (%s)",
                     self._in_flight.step, self._in_flight.result().error)

    def _discard(self, step: int, uploading: bool = False) -> None:
        """Remove a failed save's partial directory now: on a full disk it holds the room
        the next save needs (retention would only clean it after a success). On an object
        store that is `step_X` itself, half-uploaded when the failure came `uploading`
        (before, it may still hold a complete checkpoint of that step: a rollback's)."""
        remote_dir = self._remote_dir(step)
        if self.rank == 0 and (self.remote.renames or uploading):
            try:
                self.remote.remove(self.remote.path(remote_dir))
            except Exception:  # the store that just failed may fail again, its own way
                pass
        if self.local and self.local_rank == 0:
            try:
                self.local.remove(self.local.path(commit.partial_dir_name(step, self.attempt)))
            except OSError:
                pass

    def _checkpoint_bytes(self) -> int:
        """About how big one checkpoint is: the newest committed one, else the failed save's
        plan (DCP plans before it writes; 0 when planned in DCP's `process`)."""
        for step in commit.committed_steps(self.remote):
            try:
                return listed_files(self.remote, commit.step_dir_name(step))[1]
            except (OSError, ValueError, KeyError, TypeError, AttributeError):
                continue
        plan = getattr(self._pending_planner, "plan", None)
        tensors = [i.tensor_data for i in getattr(plan, "items", []) if i.tensor_data]
        # this rank's share of the tensors (DCP spreads the writes), times the ranks
        return self.world_size * sum(t.size.numel() * t.properties.dtype.itemsize
                                     for t in tensors)

    def _describe(self, error: BaseException, where: str, full: bool) -> str:
        """One line: for a full disk (`full`: hardly any room was left when it failed), where
        and how much room is needed."""
        errnos = {e.errno for e in _causes(error) if isinstance(e, OSError)}
        # torch's zip writer reports a short write as "unexpected pos", with no errno to go by
        if not (errnos & set(NO_SPACE) or (full and not errnos)):
            return one_line(dcp_cause(error))
        keep, size = self.options.keep_last, self._checkpoint_bytes()
        room = (f"about {_megabytes((keep + 1) * size)} ({keep + 1} checkpoints of about "
                f"{_megabytes(size)})" if size else f"room for {keep + 1} checkpoints")
        free = _free_bytes(where)
        key = "checkpoint.staging_dir" if where == str(self.staging) else "checkpoint.dir"
        return (f"no space left on device at {where}: checkpoint.keep_last={keep} needs "
                f"{room}, the kept ones and the next"
                + (f"; {_megabytes(free)} free" if free < float("inf") else "")
                + f": free some space, lower checkpoint.keep_last or point {key} elsewhere")

    def close(self) -> None:
        """Wait for the last save; raise if it failed (a run must end on a checkpoint).

        A collective when there is a staging tier: past it no rank touches staging again,
        so each node's last partial goes too.
        """
        ok = self.wait(report=False)
        if self.local:
            if self.group is not None and self.world_size > 1:
                dist.barrier(group=self.group)
            if self.rank != 0 and self.local_rank == 0:
                self._clean_local_partials()
        if not ok:
            raise CheckpointError(f"the final checkpoint (step {self._in_flight.step}) failed: "
                                  f"{self._in_flight.result().error}")

    # ---- retention ----

    def _verified_once(self, store: Store, step: int) -> bool:
        """Complete, checksums included; each checkpoint is hashed once per process."""
        key = (store.url, step)
        if key not in self._verified:
            try:
                commit.verify(store, commit.step_dir_name(step), step)
            except commit.Incomplete:
                return False
            self._verified.add(key)
        return True

    def apply_retention(self, newest: int) -> None:
        """Keep the newest `keep_last` complete checkpoints; drop older ones and leftovers.

        Runs only after `newest` is complete, and counts only checkpoints whose checksums
        verify, so neither a failed save nor a rotten checkpoint can push out a good one.
        """
        for store in [self.remote] + ([self.local] if self.local else []):
            kept = 0
            for step in commit.committed_steps(store):
                if step > newest and not store.renames:
                    continue  # on an object store, another rank may be uploading it now
                complete = self._verified_once(store, step)
                if complete and step <= newest and kept < self.options.keep_last:
                    kept += 1
                elif step < newest or not complete:
                    store.remove(store.path(commit.step_dir_name(step)))
            for name in store.listdir():
                if commit.PARTIAL_DIR.match(name) and not self._in_progress(name, newest):
                    store.remove(store.path(name))

    def _in_progress(self, partial: str, newest: int) -> bool:
        """A partial of this attempt past `newest`: another rank may already be writing its
        next save there (its save starts before it meets this rank in DCP's collective)."""
        match = commit.PARTIAL_DIR.match(partial)
        return (bool(match) and partial.endswith(f"-{self.attempt}")
                and int(match.group(1)) > newest)

    # ---- load ----

    def complete_checkpoints(self) -> Iterator[Tuple[int, int]]:
        """(step, world size that saved it) of each complete checkpoint, newest first, the
        same on every rank. A collective: every rank reads its share of each candidate's
        bytes for their checksums, rather than rank 0 reading them all (a 1 B-parameter
        state with AdamW is 12 GB), so the check takes one rank's share of the time."""
        steps: Any = None
        if self.rank == 0:
            try:
                steps = commit.committed_steps(self.remote)
            except Exception as err:  # after the store's retries; every rank must hear of it
                steps = (f"cannot list the checkpoints in {self.remote.url} ({one_line(err)}): "
                         f"check checkpoint.dir, the store and its credentials")
        steps = self._broadcast(steps)
        if isinstance(steps, str):
            raise CheckpointError(steps)
        for step in steps:
            world_size = self._verify_together(step)
            if world_size is not None:
                if self.rank == 0:  # its checksums were just read: retention need not again
                    self._verified.add((self.remote.url, step))
                yield step, world_size

    def _verify_together(self, step: int) -> Optional[int]:
        """The world size that saved checkpoint `step` when it is complete, else None (rank 0
        says why in one warning). Rank 0 reads the markers and hands out what they list;
        each rank checks the checksums of its share (`commit.share_of`); one all-reduce
        finds the first file that failed; then rank 0 reads `.metadata`."""
        name = commit.step_dir_name(step)
        layout: Any = None
        if self.rank == 0:
            try:
                layout = commit.checked_layout(self.remote, name, step)
            except commit.Incomplete as why:
                layout = str(why)
            except Exception as err:  # after the store's retries; every rank must hear of it
                layout = f"unreadable ({one_line(err)})"
        layout = self._broadcast(layout)
        why = layout if isinstance(layout, str) else None
        if why is None:
            world_size, listed = layout
            names = sorted(listed)
            mine = commit.share_of(listed, self.rank, self.world_size)
            failure = commit.first_mismatch(self.remote, name, listed, mine)
            # the first failure in `names` order: 2 x position + kind, or past the end
            code = (2 * len(names) if failure is None
                    else 2 * names.index(mine[failure[0]]) + failure[1])
            code = (code if self.group is None
                    else smallest(code, group=self.group))
            if code < 2 * len(names):
                why = commit.describe_mismatch(names, (code // 2, code % 2))
            elif self.rank == 0:
                try:
                    commit.check_metadata(self.remote, name, listed)
                except commit.Incomplete as bad:
                    why = str(bad)
            why = self._broadcast(why)
        if why is None:
            return world_size
        if self.rank == 0:
            log.warning("checkpoint %s is incomplete (%s): skipping it",
                        self.remote.url_of(name), why)
        return None

    def load(self, step: int, state: Dict[str, Any], partial: bool = False,
             source: Optional[str] = None) -> bool:
        """Load checkpoint `step` into `state` on every rank; False, with one warning, when it
        fails to load (e.g. a re-signed hostile pickle), like an incomplete one. `partial`:
        keys `state` has and the checkpoint lacks keep their live values. `source`: where
        to read it, as `_load_source` chose (default: choose now)."""
        source = source or self._load_source(step)
        local = source != self.remote.url_of(commit.step_dir_name(step))
        try:
            dcp.load(state, storage_reader=safe_reader(source, local,
                                                       self.remote.storage_options),
                     planner=SafeLoadPlanner(allow_partial_load=partial), **self._dcp_kwargs())
        except CheckpointException as err:
            log.warning("checkpoint %s failed to load (%s): skipping it", source,
                        one_line(dcp_cause(err)))
            return False
        self._newest_complete = step
        return True

    def load_latest(self, state: Dict[str, Any],
                    optional_keys: Callable[[int], List[str]] = lambda world: [],
                    header: Optional[Dict[str, Any]] = None,
                    check: Callable[[int], None] = lambda step: None,
                    at_most: Optional[int] = None) -> Optional[Loaded]:
        """Load the newest complete checkpoint (none after step `at_most`) that loads into
        `state`, skipping bad ones; what it loaded, or None when none does. The `header`
        loads first, partially (a key a checkpoint lacks keeps the value it holds), and
        `check(step)` may refuse the checkpoint by raising; then `state`, less the top-level
        keys `optional_keys(saved_world_size)` names (e.g. per-rank RNG when the world size
        changed). The one loop of both the trainer's resume and rollback."""
        try:
            for step, saved_world in self.complete_checkpoints():
                if at_most is not None and step > at_most:
                    continue
                start = time.perf_counter()
                source = self._load_source(step)  # once: it reads the local copy's bytes
                if header is not None and not self.load(step, header, True, source):
                    continue
                check(step)
                skip = set(optional_keys(saved_world))
                if self.load(step, {k: v for k, v in state.items() if k not in skip},
                             source=source):
                    log.info("resumed from %s (step %d, saved at world size %d) in %.1fs",
                             self.remote.url_of(commit.step_dir_name(step)), step, saved_world,
                             time.perf_counter() - start)
                    return Loaded(step, saved_world)
            return None
        finally:  # the `.metadata` kept for the load is not needed past it
            forget_parsed()

    def _load_source(self, step: int) -> str:
        """The local tier when every rank holds the same complete step there, else the
        remote (as a URL DCP's readers understand). A collective. Ranks of one node read one
        copy, so they share its checksums as resume shares the remote's (`_verify_together`);
        across nodes, each rank checks the whole copy it would read."""
        name = commit.step_dir_name(step)
        listed = self._local_copy(name, step)
        if self._all_true(listed is not None):
            one_node = self._all_true(self.node_rank == 0)
            names = (commit.share_of(listed, self.rank, self.world_size) if one_node
                     else sorted(listed))
            if self._all_true(commit.first_mismatch(self.local, name, listed, names) is None):
                return str(self.staging / name)
        return self.remote.url_of(name)

    def _local_copy(self, name: str, step: int) -> Optional[Dict[str, FileRecord]]:
        """The files of this node's staging copy of `name` when it is complete and signed by
        the same markers as the remote copy (whose `.metadata` resume has checked: the same
        checksum is the same bytes), else None."""
        if not (self.staging and (self.staging / name).is_dir()):
            return None
        try:
            _, listed = commit.checked_layout(self.local, name, step)
            same = all(self.local.read_bytes(self.local.path(name, commit.marker_name(r)))
                       == self.remote.read_bytes(self.remote.path(name, commit.marker_name(r)))
                       for r in commit.markers_present(self.local, name))
        except (commit.Incomplete, OSError):
            return None
        return listed if same else None

    def has_any_checkpoint(self) -> bool:
        return bool(commit.committed_steps(self.remote))

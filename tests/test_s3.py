"""Training against a real S3 API: SeaweedFS on loopback, reached through s3fs, for the data
(`data.root=s3://...`) and the checkpoints (`checkpoint.dir=s3://...`). The server's own
request log is the evidence of what was fetched."""

from __future__ import annotations

import json
import logging
import re
import subprocess
import uuid
from collections import Counter
from pathlib import Path
from typing import Dict, Iterator, Optional

import pytest
import s3fs  # the test extra installs it: without it these tests fail, never skip

from safetensors.torch import load_file

from checkpointing import commit, export, verify
from checkpointing.checksums import WRITE_ALGORITHM, marker_entry
from checkpointing.manager import CheckpointManager, CheckpointOptions
from checkpointing.storage import Store
from support.checkpoints import assert_same_contents, checkpoint_contents
from support.launch import PYTHON, free_port, train_env, wait_for
from support.ledger import assert_exactly_once, samples_per_rank
from support.runs import compose_config, tiny_overrides
from support.s3 import SeaweedFS
from support.tiny_job import Job, same, two_checkpoints
from train.resume.checkpoint import training_config
from train.config import default_run_name
from train.tracking.tracker import mlflow_params
from test_secrets import files_holding


@pytest.fixture(scope="module")
def seaweedfs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedFS]:
    """One server for this module's tests, its endpoint and key in this process's
    environment (and so in the trainers it starts), as a user would export them."""
    server = SeaweedFS(tmp_path_factory.mktemp("seaweedfs"), extra=("-v=2",)).start()
    with pytest.MonkeyPatch.context() as env:
        for name, value in server.env().items():
            env.setenv(name, value)
        try:
            yield server
        finally:
            server.stop()


def new_bucket(server: SeaweedFS) -> str:
    bucket = f"t{uuid.uuid4().hex[:12]}"  # S3 bucket names: 3-63 lowercase characters
    client(server).mkdir(bucket)
    return bucket


def client(server: SeaweedFS):
    """The tests' own view of the store, with the key that may create and delete buckets."""
    return s3fs.S3FileSystem(key=server.admin_key, secret=server.secret,
                             skip_instance_cache=True, endpoint_url=server.endpoint)


def jpeg_gets(server: SeaweedFS, offset: int, prefix: str) -> Counter:
    """How often the server sent each JPEG under `/prefix`, after `offset` of its log."""
    with open(server.root / "weed.log", "rb") as f:
        f.seek(offset)
        text = f.read().decode(errors="replace")
    return Counter(re.findall(rf'" GET "(/{re.escape(prefix)}/[^"?]+\.jpg)" 200', text))


def log_size(server: SeaweedFS) -> int:
    return (server.root / "weed.log").stat().st_size


def train(tmp_path: Path, root: str, *extra: str, fault: str = "",
          env: Optional[Dict[str, str]] = None) -> subprocess.CompletedProcess:
    """`python -m train` on the tiny dataset at `root`, checkpointing every 4 steps (4, 8,
    12); `env`: the whole environment (default: the tests' trainers')."""
    args = ["-m", "train", *tiny_overrides(root), "model=tiny_cnn",
            "model.dropout=0.3", "logger=none", "trainer.device=cpu",
            "checkpoint.interval_steps=4", "checkpoint.keep_last=2",
            f"audit.ledger={tmp_path / 'ledger.jsonl'}", f"run.root={tmp_path / 'runs'}",
            f"data.cache_dir={tmp_path / 'cache'}", *extra]
    return subprocess.run([*PYTHON, *args], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300, env=env or train_env(
                              **({"GOODPUT_FAULT": fault} if fault else {})))


def ok(result: subprocess.CompletedProcess) -> str:
    """The log of a run that succeeded (Hydra logs to stdout, warnings go to stderr)."""
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout + result.stderr


def verify_lines(url: str, capsys: pytest.CaptureFixture) -> tuple:
    """(exit code, [name, verdict] per line) of `python -m checkpointing.verify URL`, run
    here: the endpoint and key are in this process's environment as in a user's shell."""
    code = verify.main([url])
    return code, [line.split("  ")[:2] for line in capsys.readouterr().out.splitlines()]


def final_contents(server: SeaweedFS, url: str, tmp_path: Path) -> dict:
    """The items of the checkpoint at `url`, downloaded."""
    local = tmp_path / "downloaded"
    client(server).get(url.removeprefix("s3://"), str(local), recursive=True)
    return checkpoint_contents(local)


@pytest.fixture(scope="module")
def s3_run(seaweedfs: SeaweedFS, tiny_root: Path, tmp_path_factory) -> dict:
    """An uninterrupted run from the mounted dataset, checkpointing to s3://BUCKET/run."""
    tmp = tmp_path_factory.mktemp("s3_run")
    bucket = new_bucket(seaweedfs)
    log = ok(train(tmp, str(tiny_root), f"checkpoint.dir=s3://{bucket}/run", "run.name=r"))
    return {"bucket": bucket, "tmp": tmp, "log": log,
            "contents": final_contents(seaweedfs, f"s3://{bucket}/run/step_000000012", tmp),
            "samples": samples_per_rank(tmp / "ledger.jsonl")}


def test_checkpoints_to_s3_commit_retain_verify_and_export(seaweedfs, s3_run, tmp_path,
                                                           capsys):
    bucket = s3_run["bucket"]
    assert "checkpoint at step" not in s3_run["log"]  # none failed, none not uploaded
    assert "][ERROR]" not in s3_run["log"]
    # retention (keep_last=2) on the object store: only complete steps, no partials
    assert client(seaweedfs).ls(f"{bucket}/run") == [f"{bucket}/run/step_000000008",
                                                      f"{bucket}/run/step_000000012"]
    assert verify_lines(f"s3://{bucket}/run", capsys) == (0, [
        ["step_000000012", "complete"], ["step_000000008", "complete"]])
    out = tmp_path / "model.safetensors"
    assert export.main([f"s3://{bucket}/run", str(out)]) == 0
    assert capsys.readouterr().out.startswith(
        f"exported the model of s3://{bucket}/run/step_000000012 (step 12)")
    exported = load_file(out)
    assert exported and all(
        exported[k].equal(s3_run["contents"][f"model.{k}"]) for k in exported)


def test_sigkill_during_an_upload_then_the_same_command_resumes_from_s3(
        seaweedfs, s3_run, tiny_root, tmp_path, capsys):
    """Killed while uploading its 2nd checkpoint (step 8): the half-uploaded step_8 is never
    trusted; the same command, on a machine whose staging tier is empty, resumes from step 4
    on S3 and ends bit-identical to the uninterrupted run."""
    bucket = new_bucket(seaweedfs)
    args = [str(tiny_root), f"checkpoint.dir=s3://{bucket}/run", "run.name=r"]
    killed = train(tmp_path, *args, f"checkpoint.staging_dir={tmp_path / 'stage1'}",
                   fault="kill:rank=0:save=2:phase=uploading")
    assert killed.returncode == -9, killed.stderr[-3000:]
    code, lines = verify_lines(f"s3://{bucket}/run", capsys)
    assert code == 1 and lines == [["step_000000008", "INCOMPLETE: no commit marker"],
                                   ["step_000000004", "complete"]]

    log = ok(train(tmp_path, *args, f"checkpoint.staging_dir={tmp_path / 'stage2'}"))
    assert (f"checkpoint s3://{bucket}/run/step_000000008 is incomplete (no commit marker): "
            f"skipping it") in log, log[-3000:]
    assert f"resumed from s3://{bucket}/run/step_000000004 (step 4" in log
    assert_same_contents(final_contents(seaweedfs, f"s3://{bucket}/run/step_000000012",
                                        tmp_path), s3_run["contents"])
    assert_exactly_once(tmp_path / "ledger.jsonl")


def test_training_from_s3_gets_each_object_once_per_node(seaweedfs, s3_run, tiny_root,
                                                         tmp_path):
    """Two epochs from s3://: every object fetched once (the node cache), none on a rerun,
    the samples in the order of a run from the mounted dataset. The key and endpoint come
    only from `data.storage_options` here, and the secret reaches no log, name or stored
    file."""
    bucket = new_bucket(seaweedfs)
    client(seaweedfs).put(str(tiny_root), f"{bucket}/shapes", recursive=True)
    env = {k: v for k, v in train_env().items() if not k.startswith("AWS_")}
    options = [f"+data.storage_options.endpoint_url={seaweedfs.endpoint}",
               f"+data.storage_options.key={seaweedfs.key}",
               f"+data.storage_options.secret='{seaweedfs.secret}'"]
    offset = log_size(seaweedfs)
    log = ok(train(tmp_path, f"s3://{bucket}/shapes", *options, env=env))
    jpegs = sorted(f"/{bucket}/shapes/{p.relative_to(tiny_root)}"
                   for p in tiny_root.rglob("*.jpg"))
    assert jpeg_gets(seaweedfs, offset, f"{bucket}/shapes") == Counter({f: 1 for f in jpegs})
    assert samples_per_rank(tmp_path / "ledger.jsonl") == s3_run["samples"]

    offset = log_size(seaweedfs)
    log += ok(train(tmp_path, f"s3://{bucket}/shapes", *options, "run.name=again",
                    "checkpoint.enabled=false", env=env))
    assert jpeg_gets(seaweedfs, offset, f"{bucket}/shapes") == Counter()
    assert seaweedfs.secret not in log
    assert files_holding(tmp_path, seaweedfs.secret) == []  # names, checkpoints, records


def test_storage_options_secrets_stay_out_of_names_params_and_saved_configs():
    secret = "sk/Secret+Value"
    cfg = compose_config([f"+data.storage_options.secret={secret}",
                          "+data.storage_options.endpoint_url=http://127.0.0.1:9000",
                          f"+checkpoint.storage_options.client_kwargs.aws_session_token={secret}"])
    assert cfg.data.storage_options.secret == secret  # what the filesystem gets
    params = mlflow_params(cfg)
    assert params["data.storage_options.secret"] == "***"
    assert params["checkpoint.storage_options.client_kwargs.aws_session_token"] == "***"
    assert params["data.storage_options.endpoint_url"] == "http://127.0.0.1:9000"
    assert not [k for k in training_config(cfg) if "storage_options" in k]
    assert default_run_name("resnet", [f"+data.storage_options.secret={secret}",
                                       "optim.lr=0.1"], []) == "resnet-optim.lr=0.1"


def test_a_bucket_gone_mid_run_is_one_warning_and_the_next_checkpoint_uploads(
        seaweedfs, tmp_path, caplog):
    bucket = new_bucket(seaweedfs)
    fs = client(seaweedfs)
    mgr = CheckpointManager(CheckpointOptions(dir=f"s3://{bucket}/ck", keep_last=2,
                                              staging_dir=str(tmp_path / "stage")))
    job = Job()
    mgr.save(1, job.state())
    assert mgr.wait()
    fs.rm(bucket, recursive=True)  # the bucket, and everything in it, gone
    with caplog.at_level(logging.INFO, logger="checkpointing"):
        for step in (2, 3):
            job.step()
            mgr.save(step, job.state())
            assert mgr.wait() is False  # training goes on
        fs.mkdir(bucket)
        job.step()
        mgr.save(4, job.state())
        assert mgr.wait()
    ours = [r for r in caplog.records if r.name.startswith("checkpointing")]
    assert [r.levelname for r in ours] == ["WARNING", "INFO", "INFO"]
    assert ours[0].getMessage().startswith(
        f"checkpoint at step 2 could not be uploaded to checkpoint.dir s3://{bucket}/ck (")
    assert ours[2].getMessage().startswith(f"checkpoint.dir s3://{bucket}/ck is reachable "
                                           f"again: step 4 uploaded after 2 failed")
    fresh = CheckpointManager(CheckpointOptions(dir=f"s3://{bucket}/ck",
                                                staging_dir=str(tmp_path / "empty")))
    loaded = Job(seed=1)
    assert fresh.load_latest(loaded.state()).step == 4
    assert same(loaded.snapshot(), job.snapshot())


PROBE_BUCKET = "gone"


def accepts_writes(fs) -> bool:
    """Whether a restarted server takes a PUT yet (its S3 port answers before its volume
    server has registered)."""
    try:
        fs.pipe_file(f"{PROBE_BUCKET}/probe", b"x")
    except Exception:  # refused or unanswered: botocore's errors are its own, not OSError
        return False
    return True


def test_an_endpoint_gone_mid_run_is_one_warning_and_the_upload_retried(tmp_path, caplog):
    """The server killed mid-run, then back: the credentials and endpoint come from
    `checkpoint.storage_options` (none from the environment), with botocore's retries cut
    to one attempt so that each failure is quick."""
    server = SeaweedFS(tmp_path / "server").start()
    try:
        admin = client(server)
        admin.mkdir(PROBE_BUCKET)
        options = {"endpoint_url": server.endpoint, "key": server.key, "secret": server.secret,
                   "config_kwargs": {"retries": {"max_attempts": 1}}}
        mgr = CheckpointManager(CheckpointOptions(dir=f"s3://{PROBE_BUCKET}/ck",
                                                  staging_dir=str(tmp_path / "stage"),
                                                  storage_options=options))
        job = Job()
        mgr.save(1, job.state())
        assert mgr.wait()
        server.stop()
        with caplog.at_level(logging.INFO, logger="checkpointing"):
            job.step()
            mgr.save(2, job.state())
            assert mgr.wait() is False
            server.start()  # the same ports and data
            wait_for(lambda: accepts_writes(admin), "SeaweedFS to take writes again", 60)
            job.step()
            mgr.save(3, job.state())
            assert mgr.wait()
        ours = [r for r in caplog.records if r.name.startswith("checkpointing")]
        assert [r.levelname for r in ours] == ["WARNING", "INFO"]
        assert ours[0].getMessage().startswith(f"checkpoint at step 2 could not be uploaded "
                                               f"to checkpoint.dir s3://{PROBE_BUCKET}/ck (")
        assert server.secret not in caplog.text
        fresh = CheckpointManager(CheckpointOptions(dir=f"s3://{PROBE_BUCKET}/ck",
                                                    staging_dir=str(tmp_path / "empty"),
                                                    storage_options=options))
        loaded = Job(seed=1)
        assert fresh.load_latest(loaded.state()).step == 3
        assert same(loaded.snapshot(), job.snapshot())
    finally:
        server.stop()


@pytest.mark.parametrize("gone", ["bucket", "endpoint"])
def test_a_store_gone_at_start_is_one_line_and_exit_2(seaweedfs, tiny_root, tmp_path, gone):
    """The endpoint comes from `checkpoint.storage_options` here: nothing listens there."""
    where = ([f"checkpoint.dir=s3://nosuchbucket{uuid.uuid4().hex[:8]}/run"] if gone == "bucket"
             else [f"checkpoint.dir=s3://{new_bucket(seaweedfs)}/run",
                   f"+checkpoint.storage_options.endpoint_url=http://127.0.0.1:{free_port()}",
                   "+checkpoint.storage_options.config_kwargs.retries.max_attempts=1"])
    result = train(tmp_path, str(tiny_root), *where)
    assert result.returncode == 2, result.stderr[-3000:]
    lines = result.stderr.strip().splitlines()
    errors = [line for line in lines if "error" in line.lower()]
    assert len(errors) == 1 and errors[0].startswith(
        f"error: {where[0]} is not a writable directory ("), lines
    everything = result.stdout + result.stderr
    assert "Traceback" not in everything and "step 1/" not in everything
    assert seaweedfs.secret not in everything


@pytest.mark.parametrize("attempts", [("a", "a"), ("a", "b"), (None, "b")])
def test_markers_of_different_save_attempts_never_make_a_checkpoint(tmp_path, attempts):
    """On an object store a dead attempt's marker can sit beside this attempt's files (no
    rename separates them): only markers that all name one attempt vouch for a step."""
    root, _ = two_checkpoints(tmp_path)
    step_dir = root / "step_000000002"
    body = json.loads((step_dir / "commit_rank_0.json").read_text())
    for rank, attempt in enumerate(attempts):
        marker = {**body, "rank": rank, "world_size": 2, "attempt": attempt,
                  "files": body["files"] if rank == 0 else {}}
        (step_dir / f"commit_rank_{rank}.json").write_text(json.dumps(marker))
    store = Store(str(root))
    if attempts[0] == attempts[1]:
        assert commit.verify(store, step_dir.name, 2) == 2
    else:
        with pytest.raises(commit.Incomplete, match="commit markers of different save attempts"):
            commit.verify(store, step_dir.name, 2)


@pytest.mark.parametrize("tool", ["verify", "export"])
def test_verify_and_export_against_a_dead_endpoint_are_one_line_and_exit_2(seaweedfs,
                                                                           tmp_path, tool):
    """botocore's own errors (not OSError) reach the command line: one line, no traceback."""
    dead = f"http://127.0.0.1:{free_port()}"
    result = subprocess.run(
        [*PYTHON, "-m", f"checkpointing.{tool}", f"s3://{new_bucket(seaweedfs)}/run",
         *([str(tmp_path / "model.pt")] if tool == "export" else [])],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
        env=train_env(AWS_ENDPOINT_URL=dead, AWS_MAX_ATTEMPTS="1"))
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr and result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: cannot read s3://") \
        and "EndpointConnectionError" in lines[0], lines


@pytest.mark.parametrize("url", ["s3://AKIDLEAK:s3cr3t/with+slash@{bucket}/run",
                                 "s3://{bucket}/run?X-Amz-Signature=s3cr3t"])
def test_verify_and_export_refuse_credentials_in_the_url_in_one_line(seaweedfs, tmp_path,
                                                                     capsys, url):
    """s3fs takes no key from the URL: it would reach botocore as a bucket name, and its
    error (with the secret) the terminal. Refused before any request, the secret unshown."""
    url = url.format(bucket=new_bucket(seaweedfs))
    assert verify.main([url]) == 2
    assert export.main([url, str(tmp_path / "model.pt")]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 2 and all("holds credentials in its URL" in line for line in lines)
    assert "s3cr3t" not in captured.out + captured.err and "AKIDLEAK" not in captured.err


def test_export_from_s3_downloads_only_what_the_markers_list(seaweedfs, s3_run, tmp_path,
                                                            capsys):
    """Objects planted beside a checkpoint (another writer, a console upload: big files,
    nested keys) are never fetched: the server's log shows no GET of them."""
    bucket, fs = s3_run["bucket"], client(seaweedfs)
    step = f"{bucket}/planted/step_000000012"
    fs.copy(f"{bucket}/run/step_000000012", step, recursive=True)
    for key in ("junk.bin", "nested/deeper/junk.bin", "__9_9.distcp"):
        fs.pipe_file(f"{step}/{key}", b"\0" * 4096)
    offset = log_size(seaweedfs)
    out = tmp_path / "model.safetensors"
    assert export.main([f"s3://{bucket}/planted", str(out)]) == 0, capsys.readouterr().err
    with open(seaweedfs.root / "weed.log", "rb") as f:
        f.seek(offset)
        gets = re.findall(r'" GET "(/[^"?]+)"', f.read().decode(errors="replace"))
    assert f"/{step}/.metadata" in gets  # the log does show what was fetched
    assert not [g for g in gets if "junk" in g or "__9_9" in g], gets
    exported = load_file(out)
    assert exported and all(
        exported[k].equal(s3_run["contents"][f"model.{k}"]) for k in exported)


@pytest.mark.parametrize("forged", ["beyond the world", "another rank's name"])
def test_a_forged_marker_with_the_right_attempt_never_vouches_for_its_files(tmp_path, forged):
    """The attempt sits in every real marker for anyone to copy, as on an object store
    where nothing but verification separates a writer's objects from the checkpoint's."""
    root, _ = two_checkpoints(tmp_path)
    step_dir = root / "step_000000002"
    body = json.loads((step_dir / "commit_rank_0.json").read_text())
    planted = b"planted"
    (step_dir / "extra.distcp").write_bytes(planted)
    store = Store(str(root))
    entry = marker_entry(len(planted), WRITE_ALGORITHM,
                         store.checksum(str(step_dir / "extra.distcp"), WRITE_ALGORITHM))
    forged_body = {**body, "rank": 1 if forged == "beyond the world" else 0,
                   "files": {"extra.distcp": entry}}
    (step_dir / "commit_rank_1.json").write_text(json.dumps(forged_body))
    with pytest.raises(commit.Incomplete, match="commit_rank_1.json is not the marker of rank 1"):
        commit.verify(store, step_dir.name, 2)


@pytest.mark.parametrize("url", ["s3://{bucket}//run", "s3://{bucket}/a//run/"])
def test_an_object_store_url_with_a_double_slash_is_one_line_and_exit_2(seaweedfs, capsys,
                                                                         url):
    """Seen with SeaweedFS: a save to `s3://b//run` hung until the commit timeout (listings
    drop the empty segment, reads keep it), and verify called its own checkpoints
    unreadable."""
    url = url.format(bucket=new_bucket(seaweedfs))
    with pytest.raises(ValueError, match=r"has an empty path segment \('//'\)"):
        CheckpointManager(CheckpointOptions(dir=url))
    assert verify.main([url]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"error: {url} has an empty path segment ('//'): write it with single slashes"]
    assert Store(f"s3://{url.split('/')[2]}/run/").root.endswith("/run")  # a trailing "/" is fine

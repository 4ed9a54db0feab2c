"""Credentials typed into a URL stay in the URL: no log line, name, tracker or stored file
gets them (Hydra's `.hydra/` record of the command line is the user's own)."""

from __future__ import annotations

import base64
import functools
import logging
import threading
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Iterator, List

import pytest

from common.redact import CredentialFilter, strip_credentials
from support.launch import PYTHON, launch, run_train
from support.runs import tiny_overrides

USER, PASSWORD = "user", "s3cret"


class BasicAuthHandler(SimpleHTTPRequestHandler):
    """Serves a folder (with the directory listings fsspec's HTTP filesystem parses) only to
    requests that carry USER:PASSWORD; counts what it answered."""

    expected = "Basic " + base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()
    answered: List[int] = []

    def send_head(self):  # GET and HEAD both come through here
        if self.headers.get("Authorization") != self.expected:
            self.send_response(401)
            self.send_header("WWW-Authenticate", 'Basic realm="data"')
            self.send_header("Content-Length", "0")
            self.end_headers()
            self.answered.append(401)
            return None
        self.answered.append(200)
        return super().send_head()

    def log_message(self, format: str, *args) -> None:
        pass


@pytest.fixture
def auth_server(tiny_root: Path) -> Iterator[str]:
    handler = functools.partial(BasicAuthHandler, directory=str(tiny_root))
    BasicAuthHandler.answered = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def files_holding(root: Path, secret: str) -> List[str]:
    """Every path under `root` (outside `.hydra/` folders) whose name or bytes hold `secret`,
    in any encoding numpy or a database might store text in."""
    encoded = [secret.encode(codec) for codec in ("utf-8", "utf-16-le", "utf-32-le")]
    hits = []
    for path in root.rglob("*"):
        if ".hydra" in path.relative_to(root).parts:
            continue
        data = path.read_bytes() if path.is_file() else b""
        if secret in path.name or any(e in data for e in encoded):
            hits.append(str(path.relative_to(root)))
    return hits


def test_a_password_in_data_root_reaches_no_log_name_tracker_or_stored_file(
        auth_server, tmp_path):
    """End to end over HTTP basic auth: the run trains from the password-protected server,
    then nothing under the run root, cache, checkpoints or MLflow store holds the password."""
    root = f"http://{USER}:{PASSWORD}@{auth_server}"
    db = tmp_path / "mlflow.db"
    result = run_train(["+experiment=resnet", *tiny_overrides(root), "model=tiny_cnn",
                        "trainer.device=cpu", "trainer.max_steps=2",
                        f"logger.tracking_uri=sqlite:///{db}", f"run.root={tmp_path / 'runs'}",
                        f"data.cache_dir={tmp_path / 'cache'}",
                        f"checkpoint.dir={tmp_path / 'ck'}"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert 200 in BasicAuthHandler.answered  # the password did reach the server, as auth
    assert (tmp_path / "cache").is_dir() and list((tmp_path / "ck").iterdir()) and db.is_file()
    assert (tmp_path / "runs").is_dir() and list((tmp_path / "mlruns").rglob("config.yaml"))
    assert PASSWORD not in result.stdout + result.stderr
    assert files_holding(tmp_path, PASSWORD) == []
    logs = list((tmp_path / "runs").rglob("train.log"))
    assert logs and f"http://{auth_server}" in logs[0].read_text()  # URLs still logged, bare


@pytest.mark.parametrize("text, expected", [
    ("http://user:s3cret@host/data", "http://host/data"),
    ("https://u:p%40ss@host:8443/a?b=1", "https://host:8443/a?b=1"),
    ("webdav+https://user:s3@cret@host/x", "webdav+https://host/x"),  # an unescaped "@"
    ("s3://key:s3cret@bucket/x and ftp://me@h/y", "s3://bucket/x and ftp://h/y"),
    ("data.root=http://user:s3cret@host/data,x=1", "data.root=http://host/data,x=1"),
    ("http://h/x?X-Amz-Signature=abc&n=1", "http://h/x?X-Amz-Signature=***&n=1"),
    ("https://a.blob.core.windows.net/c?sv=1&sig=abc%2F", "https://a.blob.core.windows.net/c?sv=1&sig=***"),
    ("http://h/x?access_token=abc#frag", "http://h/x?access_token=***#frag"),
    ("/Volumes/cat/db/imagenet user@host", "/Volumes/cat/db/imagenet user@host"),
    ("mailto-like text user@example.com stays", "mailto-like text user@example.com stays"),
])
def test_strip_credentials(text: str, expected: str) -> None:
    assert strip_credentials(text) == expected


def test_the_log_filter_strips_messages_arguments_and_tracebacks() -> None:
    record = logging.LogRecord("x", logging.WARNING, __file__, 1, "listing %s failed: %r",
                               ("http://u:s3cret@h/a", {"url": "http://u:s3cret@h/b"}), None)
    try:
        raise OSError("cannot open http://u:s3cret@h/c")
    except OSError:
        import sys
        record.exc_info = sys.exc_info()
    assert CredentialFilter().filter(record)
    text = logging.Formatter().format(record)
    assert "s3cret" not in text
    assert "listing http://h/a failed" in text and "cannot open http://h/c" in text


# oci:// is known to fsspec and its package (ocifs) is in no extra of ours (s3fs now is)
@pytest.mark.parametrize("root", ["bogus://user:s3cret@host/x", "oci://user:s3cret@bucket/x"])
def test_a_data_root_fsspec_cannot_open_is_a_dataset_error(root):
    """An unknown protocol or a missing fsspec package is the user's to fix (exit 2, one
    line), not a crash that torchrun retries; the message carries no password."""
    from data.errors import DatasetError
    from data.volume import Volume

    with pytest.raises(DatasetError, match="cannot open data.root=") as caught:
        Volume(root)
    assert PASSWORD not in str(caught.value)


def test_an_unexpected_crash_prints_one_line_without_credentials(tiny_root, tmp_path):
    """Left to Hydra, any exception nobody anticipated prints `Error executing job with
    overrides: [...]` with every override verbatim, straight to stderr."""
    secret_uri = f"http://{USER}:{PASSWORD}@127.0.0.1:9/mlflow"  # unused with logger=none
    proc = launch(PYTHON, ["-m", "train", "+experiment=resnet", *tiny_overrides(tiny_root),
                           "model=tiny_cnn", "trainer.device=cpu", "trainer.max_steps=2",
                           "logger=none", f"logger.tracking_uri={secret_uri}",
                           f"run.root={tmp_path / 'runs'}", "checkpoint.enabled=false"],
                  fault="raise:step=1", cwd=tmp_path, stderr_apart=True)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 1, err[-3000:]
    errors = [line for line in err.splitlines() if not line.startswith("[")]
    assert len(errors) == 1 and errors[0].startswith(
        "error: InjectedFault: injected exception at step 1"), err[-3000:]
    assert PASSWORD not in out + err and "Traceback" not in out + err
    log = next((tmp_path / "runs").rglob("train.log")).read_text()
    assert "Traceback" in log and "InjectedFault" in log and PASSWORD not in log

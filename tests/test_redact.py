"""strip_credentials over the kinds of URL user info: a password (however it is typed) always
goes, a token as http user name goes, a bare name that is identity (abfs container, sftp
user) stays."""

from __future__ import annotations

import random
import re
import string

import fsspec
import pytest

from checkpointing.storage import Store, StoreUnavailable
from common.redact import one_line, strip_credentials
from data.errors import DatasetError
from data.volume import Volume
from train.config import default_run_name


@pytest.mark.parametrize("text, expected", [
    # identity, not secret: kept, so two containers or users stay two datasets
    ("abfs://c1@acct.dfs.core.windows.net/imagenet", "abfs://c1@acct.dfs.core.windows.net/imagenet"),
    ("sftp://alice@host:22/data", "sftp://alice@host:22/data"),
    ("s3://bucket/data@v2/x", "s3://bucket/data@v2/x"),  # an "@" in a path
    # a token as the user name of the schemes that take one
    ("https://ghp_T0KEN@github.com/x", "https://github.com/x"),
    ("webdav+https://T0KEN@h/x", "webdav+https://h/x"),
    ("FTPS://T0KEN@h/x", "FTPS://h/x"),
    # passwords, valid or not: "/", "#", "?", "@", ":" and spaces unescaped
    ("s3://AKIA:wJal/rXUt+nFEMI/K7MDENG@bucket/x", "s3://bucket/x"),
    ("sftp://alice:pa#ss?w@rd@host/x", "sftp://host/x"),
    ("http://u:my secret pass@host/x y", "http://host/x y"),
    ("http://u:a:b:c@host/x", "http://host/x"),
    ("abfs://c1:K3Y==@acct/x", "abfs://acct/x"),
    # two URLs on a line: each keeps what is its own
    ("copy s3://k:pw@b/x to sftp://alice@h/y", "copy s3://b/x to sftp://alice@h/y"),
    ("{'a': 'http://u:pw@h/a', 'b': 'abfs://c@h/b'}", "{'a': 'http://h/a', 'b': 'abfs://c@h/b'}"),
    ("http://host:8080/a and sftp://alice@h/y", "http://host:8080/a and sftp://alice@h/y"),
    # secret query values
    ("http://h/x?pass=1&pwd=2&apikey=3&access_token=4&sas=5&se=2030&sv=6",
     "http://h/x?pass=***&pwd=***&apikey=***&access_token=***&sas=***&se=2030&sv=6"),
])
def test_strip_credentials_by_kind_of_user_info(text: str, expected: str) -> None:
    assert strip_credentials(text) == expected


# Printable characters on one line: a password cannot span lines of a log.
ALPHABET = string.ascii_letters + string.digits + string.punctuation + " \t"
# The one thing a password cannot hold: what starts another URL on the line.
ANOTHER_URL = re.compile(r"[\s'\"`<(\[{=,;]+[a-zA-Z][a-zA-Z0-9+.\-]*://")


@pytest.mark.parametrize("scheme", ["http", "https", "s3", "abfs", "sftp", "webdav+https",
                                    "gs", "ftp"])
def test_no_part_of_a_password_survives_whatever_it_holds(scheme: str) -> None:
    rng = random.Random(scheme)
    secrets = ["/", "#", "?", "@", ":", " ", "@@/ ?#:", "a://b"]
    drawn = ["".join(rng.choice(ALPHABET) for _ in range(rng.randint(1, 40)))
             for _ in range(500)]
    secrets += [secret for secret in drawn if not ANOTHER_URL.search(secret)]
    assert len(secrets) > 500
    for secret in secrets:
        for text, expected in (
                (f"{scheme}://user:{secret}@host/path", f"{scheme}://host/path"),
                (f"data.root={scheme}://user:{secret}@host:9/p?q=1 then text",
                 f"data.root={scheme}://host:9/p?q=1 then text"),
                (f"a {scheme}://user:{secret}@bucket/x and b sftp://bob@h/y",
                 f"a {scheme}://bucket/x and b sftp://bob@h/y")):
            assert strip_credentials(text) == expected, text


def test_two_abfs_containers_are_two_run_names() -> None:
    names = {default_run_name("resnet", [f"data.root=abfs://{c}@acct.dfs.core.windows.net/d"],
                              []) for c in ("train-a", "train-b")}
    assert len(names) == 2


@pytest.mark.parametrize("err, expected", [
    (ValueError(), "ValueError"),  # an empty message: no IndexError, the type alone
    (RuntimeError("  \n  "), "RuntimeError"),
    (OSError("first\nsecond\nthird"), "OSError: first"),
    (ValueError("cannot reach s3://AKIA:s3cr3t@bucket/x"),
     "ValueError: cannot reach s3://bucket/x"),
])
def test_one_line_is_the_type_and_first_line_without_credentials(err, expected) -> None:
    assert one_line(err) == expected


def test_one_line_is_bounded() -> None:
    text = one_line(ValueError("x" * 10_000), limit=100)
    assert len(text) == 103 and text.endswith("...")


@pytest.mark.parametrize("open_it, refusal", [
    (lambda: Store("memory://bucket/ckpt"), StoreUnavailable),
    (lambda: Volume("memory://bucket/data"), DatasetError),
])
def test_an_error_with_an_empty_message_is_one_line_in_the_callers(monkeypatch, open_it,
                                                                   refusal) -> None:
    """fsspec refusing a URL with a bare `ValueError()`: the caller's one-line refusal names
    it (its inline `str(err).splitlines()[0]` raised IndexError instead)."""
    def refuse(*args, **kwargs):
        raise ValueError()
    monkeypatch.setattr(fsspec.core, "url_to_fs", refuse)
    with pytest.raises(refusal) as caught:
        open_it()
    message = str(caught.value)
    assert "ValueError" in message and "\n" not in message, message

"""Credentials never leave the URL the user typed: names, logs, trackers and stored files get
`strip_credentials(text)`.

A URL's user info is removed when it holds a password (`scheme://user:password@host`) and,
for the schemes whose user name may itself be a token (http(s), webdav, ftp(s)), whatever it
holds. A bare `name@` stays on other schemes: there it is identity, not a secret (an abfs
container, an sftp user), and two of them must not look like one dataset. The value of any
query parameter that carries a secret (pre-signed and SAS URLs: `X-Amz-Signature=`, `sig=`,
`token=`, ...) is replaced. Safe ways to pass credentials are the storage's own environment
variables or fsspec's storage options (`data.storage_options`, `checkpoint.storage_options`),
which never appear in a URL; `hide_storage_secrets` takes the options' secrets out of a record
of the config. `one_line(err)` is an error as the one line a message or a log shows.
"""

from __future__ import annotations

import logging
import re
from typing import Any

_SCHEME = r"\b[a-zA-Z][a-zA-Z0-9+.\-]*://"
# Where another URL begins: a scheme after a space, quote, bracket, "=", "," or ";".
_NEXT_URL = rf"[\s'\"`<(\[{{=,;]+{_SCHEME}"
# `user:` then a password. Unescaped, a password may hold "/", "?", "#", "@" or spaces
# (invalid, but typed all the same, and AWS secret keys hold "/"), so it runs to the last "@"
# on its line before the next URL: no part of it is left behind, at the cost of removing a
# little more when a host:port is followed on its line by an "@".
_PASSWORD = re.compile(rf"({_SCHEME})[^\s/?#@:]*:(?:(?!{_NEXT_URL})[^\r\n])*@")
# Any user info of the schemes that take a token as user name (`https://TOKEN@host`).
_TOKEN = re.compile(r"(?i)(\b(?:[a-z0-9.\-]+\+)?(?:https?|webdavs?|davs?|ftps?)://)"
                    r"[^/?#\s]*@")
_SECRET_PARAM = re.compile(
    r"(?i)([?&;][\w.\-]*(?:sig|signature|token|secret|pass|pwd|key|credential|auth|sas|jwt)"
    r"[\w.\-]*=)[^&;\s#]*")
REDACTED = "***"
# fsspec option names that hold a secret: s3fs's key/secret/token, botocore's
# aws_secret_access_key, adlfs's account_key and sas_token, a password, ...
_SECRET_OPTION = re.compile(r"(?i)key|secret|token|pass|pwd|credential|auth|sig|sas|jwt")


def strip_credentials(text: str) -> str:
    """`text` with every URL's secret user info removed and secret query values replaced."""
    text = _TOKEN.sub(r"\1", _PASSWORD.sub(r"\1", text))
    return _SECRET_PARAM.sub(rf"\g<1>{REDACTED}", text)


def one_line(err: BaseException, limit: int = 240, named: bool = True) -> str:
    """`err` as one short line without credentials: its type (unless not `named`) and its
    message's first line (MLflow's, DCP's and torchft's run to dozens), or its type alone
    when the message is empty; at most `limit` characters (a decoder may quote the file's
    own bytes)."""
    lines = str(err).strip().splitlines()
    if not lines:
        return type(err).__name__
    first = lines[0].strip()
    text = strip_credentials(f"{type(err).__name__}: {first}" if named else first)
    return text if len(text) <= limit else text[:limit] + "..."


def hide_storage_secrets(tree: Any, inside_options: bool = False) -> Any:
    """A copy of a config tree (dicts and lists) in which every value that a `storage_options`
    mapping holds under a secret's name (`key`, `secret`, `client_kwargs.aws_session_token`,
    ...) is `REDACTED`; the other options (an `endpoint_url`, a region) stay readable."""
    if isinstance(tree, dict):
        return {k: (REDACTED if inside_options and _SECRET_OPTION.search(str(k)) else
                    hide_storage_secrets(v, inside_options or k == "storage_options"))
                for k, v in tree.items()}
    if isinstance(tree, list):
        return [hide_storage_secrets(v, inside_options) for v in tree]
    return tree


class CredentialFilter(logging.Filter):
    """Strips credentials from every record it sees, traceback included.

    Install it on handlers, not loggers: a logger's filters never see the records that
    propagate to it from child loggers.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        stripped = strip_credentials(message)
        if stripped != message:
            record.msg, record.args = stripped, None
        if record.exc_info and not record.exc_text:
            # Formatters reuse exc_text when it is set, so the traceback is stripped once here.
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = strip_credentials(record.exc_text)
        if record.stack_info:
            record.stack_info = strip_credentials(record.stack_info)
        return True

"""Credentials never leave the URL the user typed: names, logs, trackers and stored files get
`strip_credentials(text)`.

A URL's user info is removed when it holds a password (`scheme://user:password@host`) and,
for the schemes whose user name may itself be a token (http(s), webdav, ftp(s)), whatever it
holds. A bare `name@` stays on other schemes: there it is identity, not a secret (an abfs
container, an sftp user), and two of them must not look like one dataset. The value of any
query parameter that carries a secret (pre-signed and SAS URLs: `X-Amz-Signature=`, `sig=`,
`token=`, ...) is replaced. Safe ways to pass credentials are the storage's own environment
variables or fsspec's configuration, which never appear in a URL.
"""

from __future__ import annotations

import logging
import re

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


def strip_credentials(text: str) -> str:
    """`text` with every URL's secret user info removed and secret query values replaced."""
    text = _TOKEN.sub(r"\1", _PASSWORD.sub(r"\1", text))
    return _SECRET_PARAM.sub(rf"\g<1>{REDACTED}", text)


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

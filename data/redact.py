"""Credentials never leave the URL the user typed: names, logs, trackers and stored files get
`strip_credentials(text)`.

A URL's user info (`scheme://user:password@host`) is removed, and so is the value of any query
parameter that carries a secret (pre-signed and SAS URLs: `X-Amz-Signature=`, `sig=`,
`token=`, ...). Safe ways to pass credentials are the storage's own environment variables or
fsspec's configuration, which never appear in a URL.
"""

from __future__ import annotations

import logging
import re

# Greedy up to the last "@" before the path: an unescaped "@" inside a password still goes.
_USERINFO = re.compile(r"(\b[a-zA-Z][a-zA-Z0-9+.\-]*://)[^/\s?#]*@")
_SECRET_PARAM = re.compile(
    r"(?i)([?&;][\w.\-]*(?:sig|signature|token|secret|password|passwd|pwd|key|credential"
    r"|auth)[\w.\-]*=)[^&;\s#]*")
REDACTED = "***"


def strip_credentials(text: str) -> str:
    """`text` with every URL's user info removed and secret query values replaced."""
    return _SECRET_PARAM.sub(rf"\g<1>{REDACTED}", _USERINFO.sub(r"\1", text))


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

"""Credentials never leave the URL the user typed: names, logs, trackers and stored files get
`strip_credentials(text)`.

A URL's user info (`scheme://user:password@host`) is removed, and so is the value of any query
parameter that carries a secret (pre-signed and SAS URLs: `X-Amz-Signature=`, `sig=`,
`token=`, ...). Safe ways to pass credentials are the storage's own environment variables or
fsspec's configuration, which never appear in a URL.
"""

from __future__ import annotations

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

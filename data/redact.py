"""The old home of credential redaction, kept so that a logging config naming
`data.redact.CredentialFilter` still loads; it lives in `common.redact`."""

from common.redact import CredentialFilter, hide_storage_secrets, strip_credentials

__all__ = ["CredentialFilter", "hide_storage_secrets", "strip_credentials"]

"""Errors a user can fix: printed as one line naming the problem and the fix, no traceback."""


class ConfigError(ValueError):
    """A config value that cannot work on this machine or with this data."""

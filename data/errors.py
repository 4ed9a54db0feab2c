"""The one exception type for data problems a user can fix (bad path, bad batch size...)."""


class DatasetError(ValueError):
    """A dataset or data setting that cannot be used as given; the message names the fix."""

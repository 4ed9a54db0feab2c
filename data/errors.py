"""The one exception type for data problems a user can fix (bad path, bad batch size...)."""

from enum import Enum

_WORKER_PREFIX = "Caught "


class DatasetError(ValueError):
    """A dataset or data setting that cannot be used as given; the message names the fix.

    Raised in a DataLoader worker, it is re-raised in the main process with the worker's
    whole traceback as its message; `str()` gives back the original one line.
    """

    def __str__(self) -> str:
        text = super().__str__()
        if text.startswith(_WORKER_PREFIX) and "\nOriginal Traceback" in text:
            last = text.rstrip().splitlines()[-1]
            return last.split(": ", 1)[1] if ": " in last else last
        return text


class OnBadFile(str, Enum):
    """What to do with a file that is not a readable JPEG (`data.on_bad_file`)."""

    skip = "skip"  # leave the sample out of its batch, warn once, count it
    fail = "fail"  # end the run with one line naming the file

"""Errors printed as one line naming the problem and the fix, no traceback, each with the
exit code a launcher or scheduler can act on."""

EXIT_CONFIG = 2  # the user must change something: restarting cannot help
EXIT_PREFLIGHT = 3  # this node failed its pre-flight check: replace the node
# Stopped on SIGTERM/SIGINT after committing a checkpoint: run the same command again.
# sysexits.h's EX_TEMPFAIL ("temporary failure; the user is invited to retry").
EXIT_PREEMPTED = 75


class ConfigError(ValueError):
    """A config value that cannot work on this machine or with this data."""


class TrainingError(RuntimeError):
    """Training cannot go on as configured (e.g. too many health rollbacks); exit code 1."""


class PreflightError(RuntimeError):
    """This rank's device or links are broken; exit code EXIT_PREFLIGHT."""

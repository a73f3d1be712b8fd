"""The one exception type for mistakes a user can make (bad mesh, bad shapes, bad data)."""


class ConfigError(ValueError):
    """A user-fixable problem. Its message is one line: what is wrong and how to fix it.

    The CLI prints it without a traceback and exits with status 2.
    """


def require(condition: bool, message: str) -> None:
    """Raise ConfigError(message) unless `condition` holds."""
    if not condition:
        raise ConfigError(message)


# Exit statuses of `python -m jdist.train` and `python -m jdist.launch`.
EXIT_OK = 0
EXIT_CRASH = 1          # an unexpected error (traceback printed)
EXIT_CONFIG = 2         # a user mistake, incl. an unusable --resume PATH (one line, no traceback)
EXIT_NONFINITE = 3      # non-finite loss/gradient under --on-nan stop (or rollback gave up)
EXIT_PREEMPTED = 75     # SIGTERM/SIGINT: a checkpoint of the current step was saved; rerun

"""The one exception type for mistakes a user can make (bad mesh, bad shapes, bad data),
and how every `python -m jdist.*` command reports them."""

import argparse
import sys
from collections.abc import Callable


class ConfigError(ValueError):
    """A user-fixable problem. Its message is one line: what is wrong and how to fix it.

    The CLI prints it without a traceback and exits with status 2.
    """


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose usage errors are ConfigErrors: one line, exit 2, like every jdist
    usage error (argparse's own would print usage and exit with its own status)."""

    def error(self, message: str) -> None:
        raise ConfigError(f"{message}; see --help")


def require(condition: bool, message: str) -> None:
    """Raise ConfigError(message) unless `condition` holds."""
    if not condition:
        raise ConfigError(message)


def run_cli(body: Callable[[], int | None]) -> int:
    """`body()` as a command's exit status (None: 0): a ConfigError is one line on stderr
    and EXIT_CONFIG, no traceback; Ctrl-C is 130."""
    try:
        return body() or EXIT_OK
    except ConfigError as e:
        print(f"jdist: error: {e}", file=sys.stderr)
        return EXIT_CONFIG
    except KeyboardInterrupt:
        print("jdist: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


# Exit statuses of `python -m jdist.train` and `python -m jdist.launch`.
EXIT_OK = 0
EXIT_CRASH = 1          # an unexpected error (traceback printed)
EXIT_CONFIG = 2         # a user mistake, incl. an unusable --resume PATH (one line, no traceback)
EXIT_NONFINITE = 3      # non-finite loss/gradient under --on-nan stop (or rollback gave up)
EXIT_CORRUPTION = 4     # silent data corruption: replicas or a recomputed step disagree bitwise
EXIT_SAVE_FAILED = 5    # a checkpoint save failed and no later save of the run replaced it
EXIT_PREEMPTED = 75     # SIGTERM/SIGINT: a checkpoint of the current step was saved; rerun
EXIT_INTERRUPTED = 130  # Ctrl-C before training started, or a second signal while stopping

"""The one exception type for mistakes a user can make (bad mesh, bad shapes, bad data),
and how every `python -m jdist.*` command reports them."""

import argparse
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path


class ConfigError(ValueError):
    """A user-fixable problem. Its message is one line: what is wrong and how to fix it.

    The CLI prints it without a traceback and exits with status 2.
    """


class HelpFormatter(argparse.HelpFormatter):
    """Appends each flag's default, unless its help already says what the default means, or
    it is a switch (off unless given) or empty."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if ("default" in text or action.nargs == 0 or action.default in ("", None, [])
                or action.default is argparse.SUPPRESS):
            return text
        return f"{text} (default: %(default)s)"


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose usage errors are ConfigErrors: one line, exit 2, like every jdist
    usage error (argparse's own would print usage and exit with its own status); `--help`
    shows each flag's default (`HelpFormatter`)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> None:
        raise ConfigError(f"{message}; see --help")


def first_paragraph(doc: str) -> str:
    """A command module's docstring up to its first blank line, as one line: its `--help`
    description (a docstring's first line may stop mid-sentence)."""
    return " ".join(doc.strip().split("\n\n")[0].split())


def require(condition: bool, message: str) -> None:
    """Raise ConfigError(message) unless `condition` holds."""
    if not condition:
        raise ConfigError(message)


def require_writable_dir(path: str | Path, given: str) -> None:
    """An output directory `path` must be one this process can fill: an existing directory,
    or one it can create (under a directory, not a file). Checked by creating and removing a
    directory in the nearest one that exists, since permission bits say nothing of /proc or
    a read-only mount. `given` is the flag and value the error names ("--out x/y.bin").
    Call before any expensive work."""
    path = Path(path)
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent  # exists() is False below a file, too: "FILE/x"
    require(existing.is_dir(), f"{given}: {existing} is a file, not a directory; choose a "
            "path under a directory")
    try:
        Path(tempfile.mkdtemp(prefix=".jdist-write-check-", dir=existing)).rmdir()
    except OSError as e:
        raise ConfigError(f"{given}: cannot create anything in {existing} "
                          f"({e.strerror or e}); choose a directory you can write to") from None


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

"""The one exception type for mistakes a user can make (bad mesh, bad shapes, bad data)."""


class ConfigError(ValueError):
    """A user-fixable problem. Its message is one line: what is wrong and how to fix it.

    The CLI prints it without a traceback and exits with status 2.
    """


def require(condition: bool, message: str) -> None:
    """Raise ConfigError(message) unless `condition` holds."""
    if not condition:
        raise ConfigError(message)

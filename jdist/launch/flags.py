"""Reading and rewriting training flags in the argument list the launcher passes on."""

from __future__ import annotations


def flag_value(args: list[str], flag: str) -> str | None:
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            return args[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return None


def without_flag(args: list[str], flag: str) -> list[str]:
    out, skip = [], False
    for a in args:
        if skip:
            skip = False
        elif a == flag:
            skip = True
        elif not a.startswith(flag + "="):
            out.append(a)
    return out


def with_flag(args: list[str], flag: str, value: str) -> list[str]:
    """`args` with `flag` set to `value` (once, at the end)."""
    return [*without_flag(args, flag), flag, value]

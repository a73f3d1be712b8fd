"""How a configuration field is declared: its default, help text, whether it decides the
run's results, and (rarely) a flag name other than the field's; the parser of a step range
(`--profile-steps`)."""

from __future__ import annotations

import dataclasses
import re

from jdist.errors import ConfigError


def flag(default, help: str, result: bool = False, name: str | None = None):
    """A field of a configuration group. `help` is required: it is the field's `--help` line.
    `result`: the field decides *what* a run computes, so a resumed run must keep it
    (`jdist.train.resume`); everything else only decides *how* and may change on resume.
    `name`: the flag (and config.json key) when it must differ from the field's name."""
    metadata = {"help": help, "result": result}
    if name is not None:
        metadata["flag"] = name
    return dataclasses.field(default=default, metadata=metadata)


def flag_name(field: dataclasses.Field) -> str:
    """The field's flag without dashes (`grad_accum` for `--grad-accum`), also its key in a
    run directory's config.json."""
    return field.metadata.get("flag", field.name)


def parse_steps(text: str) -> tuple[int, int]:
    """`--profile-steps`: "3-5" -> (3, 5), "4" -> (4, 4). Steps count from 1, as in
    metrics.jsonl."""
    match = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", text or "")
    first, last = (int(match[1]), int(match[2] or match[1])) if match else (0, 0)
    if not 1 <= first <= last:
        raise ConfigError(f"--profile-steps {text!r}: expected A-B with 1 <= A <= B "
                          f"(e.g. --profile-steps 3-5) or one step N (e.g. --profile-steps 4)")
    return first, last

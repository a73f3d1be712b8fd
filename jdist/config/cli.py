"""The command line of `python -m jdist.train`, generated from the configuration groups:
one argparse group per concern, each flag's type from its field's annotation."""

from __future__ import annotations

import dataclasses
import sys
import types
import typing

from jdist.config.fields import flag_name
from jdist.errors import ArgumentParser


def add_flag(parser, field: dataclasses.Field, hint) -> None:
    """`--field-name` parsed as the field's annotation says: a bool is a switch, a Literal
    lists its choices, `X | None` parses X and defaults to None."""
    flag = "--" + flag_name(field).replace("_", "-")
    kw = {"default": field.default, "help": field.metadata["help"],
          "dest": flag_name(field)}
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    if hint is bool:
        parser.add_argument(flag, action="store_true", **kw)
    elif typing.get_origin(hint) is typing.Literal:
        choices = list(typing.get_args(hint))
        parser.add_argument(flag, type=type(choices[0]), choices=choices, **kw)
    else:
        parser.add_argument(flag, type=hint, **kw)


def make_parser(prog: str = "python -m jdist.train",
                description: str = "Train a Llama-style model on any device mesh."):
    """One flag per configuration field, grouped by concern; usage errors raise ConfigError
    (one line, exit 2)."""
    from jdist.config import TrainConfig

    parser = ArgumentParser(prog=prog, description=description)
    for group in dataclasses.fields(TrainConfig):
        kind = group.default_factory
        title = (kind.__doc__ or "").strip().splitlines()[0]
        section = parser.add_argument_group(group.name, title)
        hints = typing.get_type_hints(kind)
        for field in dataclasses.fields(kind):
            add_flag(section, field, hints[field.name])
    return parser


def parse_args(argv: list[str] | None = None):
    from jdist.config import TrainConfig

    args = make_parser().parse_args(sys.argv[1:] if argv is None else argv)
    return TrainConfig.of(**vars(args))

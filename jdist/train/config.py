"""The training configuration moved to `jdist.config` (typed groups per concern); the old
import path stays for code written against it."""

from jdist.config import TrainConfig, make_parser, parse_args  # noqa: F401

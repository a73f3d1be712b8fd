"""`python -m jdist.train`'s configuration: one typed group of flags per concern
(`jdist.config.groups`), held by `TrainConfig`. A flag is named by its field, so flat flag
names (`zero`, `grad_accum`, as on the command line and in a run directory's config.json)
map one-to-one onto `config.<group>.<field>`."""

from __future__ import annotations

import dataclasses
from typing import Any

from jdist.config.fields import flag_name
from jdist.config.groups import (
    CheckpointFlags,
    DataFlags,
    DeviceFlags,
    FinetuneFlags,
    MemoryFlags,
    ModelFlags,
    ObserveFlags,
    OptimFlags,
    ParallelFlags,
)


@dataclasses.dataclass
class TrainConfig:
    """Every setting of a training run, by concern: `config.memory.zero`,
    `config.data.batch_size`. Built from flat flag names with `TrainConfig.of(...)`."""

    model: ModelFlags = dataclasses.field(default_factory=ModelFlags)
    finetune: FinetuneFlags = dataclasses.field(default_factory=FinetuneFlags)
    parallel: ParallelFlags = dataclasses.field(default_factory=ParallelFlags)
    devices: DeviceFlags = dataclasses.field(default_factory=DeviceFlags)
    memory: MemoryFlags = dataclasses.field(default_factory=MemoryFlags)
    optim: OptimFlags = dataclasses.field(default_factory=OptimFlags)
    data: DataFlags = dataclasses.field(default_factory=DataFlags)
    checkpoint: CheckpointFlags = dataclasses.field(default_factory=CheckpointFlags)
    observe: ObserveFlags = dataclasses.field(default_factory=ObserveFlags)

    @classmethod
    def of(cls, **flags: Any) -> TrainConfig:
        """The configuration with these flags (flat names, `grad_accum=2`) and the others at
        their defaults. Also reads a run directory's config.json: an older one lacks the
        newer flags, which were then at their defaults."""
        return cls().replace(**flags)

    def replace(self, **flags: Any) -> TrainConfig:
        """A copy with these flags (flat names) changed."""
        where = locate()
        unknown = [name for name in flags if name not in where]
        if unknown:
            raise TypeError(f"TrainConfig has no flag {unknown[0]!r}")
        changes: dict[str, dict] = {}
        for name, value in flags.items():
            group, field = where[name]
            changes.setdefault(group, {})[field] = value
        return dataclasses.replace(self, **{
            group: dataclasses.replace(getattr(self, group), **fields)
            for group, fields in changes.items()})

    def flat(self) -> dict[str, Any]:
        """Flag name -> value: the format of a run directory's config.json and of every
        checkpoint's metadata."""
        return {flag_name(f): getattr(getattr(self, group), f.name)
                for group, f in group_fields()}

    def validate(self) -> None:
        """Each group's own checks (ConfigError: one line); checks across groups are made
        where the groups meet (`jdist.train.setup`)."""
        for group in dataclasses.fields(self):
            getattr(self, group.name).validate()

    def __getattr__(self, name: str):
        # Only reached for missing attributes: say where a flag went since the groups.
        where = locate().get(name)
        hint = f"; use config.{where[0]}.{where[1]}" if where else ""
        raise AttributeError(f"TrainConfig has no attribute {name!r}{hint}")


def group_fields() -> list[tuple[str, dataclasses.Field]]:
    """(group name, field) of every flag, in `--help` order."""
    return [(group.name, field) for group in dataclasses.fields(TrainConfig)
            for field in dataclasses.fields(group.default_factory)]


def locate() -> dict[str, tuple[str, str]]:
    """Flag name -> (group name, field name)."""
    return {flag_name(f): (group, f.name) for group, f in group_fields()}


def result_flags() -> tuple[str, ...]:
    """The flags that decide *what* is computed (metadata "result"): a resumed run must keep
    them; everything else (mesh, ZeRO stage, process count, remat, ...) only decides *how*."""
    return tuple(flag_name(f) for _, f in group_fields() if f.metadata["result"])


from jdist.config.cli import make_parser, parse_args  # noqa: E402 - it builds on TrainConfig

__all__ = ["TrainConfig", "make_parser", "parse_args", "result_flags", "group_fields", "locate"]

"""Logical-axis rules: which mesh axes each logical name may shard over, and in what priority.

A rules table is an ordered list of `(logical name, candidate)` pairs; a candidate is
a mesh axis, a tuple of mesh axes, or None. Resolution follows Flax Linen: walk the
rules in order; a rule assigns its candidate to a dimension with that logical name
if the dimension is still unassigned and none of the candidate's mesh axes is used
elsewhere in the same spec. Names without a matching rule are replicated. Because
rule order is the priority, `heads -> tensor` listed before `length -> tensor` means
attention keeps heads on `tensor` while the residual stream may put length there.
"""

from __future__ import annotations

import difflib
import math
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path

from jdist.errors import ConfigError, require
from jdist.spmd import axes as ax

Candidate = str | tuple[str, ...] | None
Rules = tuple[tuple[str, Candidate], ...]

DEFAULT_RULES: Rules = (
    # Model-parallel dimensions first: they win `tensor`/`expert` over anything later.
    (ax.HEADS, ax.TENSOR),
    (ax.KV_HEADS, ax.TENSOR),
    (ax.MLP, ax.TENSOR),
    (ax.VOCAB, ax.TENSOR),
    (ax.EXPERTS, ax.EXPERT),
    # Batch over every replica-like axis; parameters' model dimension over fsdp (ZeRO-3).
    # The expert axis is data parallel for everything but the experts themselves.
    (ax.BATCH, (ax.DATA, ax.FSDP, ax.EXPERT)),
    (ax.EMBED, ax.FSDP),
    # Sequence positions over the context-parallel axis.
    (ax.LENGTH, ax.SEQUENCE),
    # The stacked blocks over pipeline stages: stage s holds a contiguous run of layers.
    (ax.LAYERS, ax.STAGE),
)


def mesh_axes_of(candidate: Candidate) -> tuple[str, ...]:
    """The mesh axes of a rule candidate or PartitionSpec entry (None, a name, or a tuple)."""
    if candidate is None:
        return ()
    return (candidate,) if isinstance(candidate, str) else tuple(candidate)


def as_candidate(axes: Sequence[str]) -> Candidate:
    """Mesh axes as a rule candidate / PartitionSpec entry: None, a name, or a tuple."""
    axes = tuple(axes)
    return None if not axes else axes[0] if len(axes) == 1 else axes


def resolve(names: Sequence[str | None], rules: Rules = DEFAULT_RULES, mesh=None):
    """Logical names -> `PartitionSpec`. With `mesh`, size-1 mesh axes are dropped."""
    from jax.sharding import PartitionSpec

    result: list[Candidate] = [None] * len(names)
    assigned = [False] * len(names)
    used: set[str] = set()
    for logical, candidate in rules:
        mesh_axes = mesh_axes_of(candidate)
        for i, name in enumerate(names):
            if name != logical or assigned[i] or used.intersection(mesh_axes):
                continue
            result[i], assigned[i] = candidate, True
            used.update(mesh_axes)
    if mesh is not None:
        result = [_drop_trivial(c, mesh.shape) for c in result]
    return PartitionSpec(*result)


def batch_split(shape: Mapping[str, int], rules: Rules = DEFAULT_RULES
                ) -> tuple[tuple[str, ...], int]:
    """(the mesh axes the global batch's rows are split over, as the rules place `batch`;
    how many ways): the one place the batch-axis product is written. `shape`: a mesh's
    shape (or a planned one's)."""
    axes = tuple(a for a in mesh_axes_of(resolve((ax.BATCH,), rules)[0]) if shape[a] > 1)
    return axes, math.prod(shape[a] for a in axes)


def _drop_trivial(candidate: Candidate, shape: Mapping[str, int]) -> Candidate:
    kept = tuple(a for a in mesh_axes_of(candidate) if shape[a] > 1)
    return as_candidate(kept)


def override(rules: Rules, updates: Mapping[str, Sequence[Candidate]]) -> Rules:
    """Replace the candidates of each logical name in `updates` (in place of its old rules).

    `override(DEFAULT_RULES, {"embed": ["tensor"], "mlp": []})` moves parameters' model
    dimension to `tensor` and replicates the MLP hidden dimension.
    """
    out: list[tuple[str, Candidate]] = []
    done: set[str] = set()
    for logical, candidate in rules:
        if logical not in updates:
            out.append((logical, candidate))
        elif logical not in done:
            out.extend((logical, _canonical(c)) for c in updates[logical])
            done.add(logical)
    for logical, candidates in updates.items():
        if logical not in done:
            out.extend((logical, _canonical(c)) for c in candidates)
    return tuple(out)


def with_sequence_parallel(rules: Rules) -> Rules:
    """Megatron sequence parallelism: between tensor-parallel regions, shard length over
    `tensor` too. Attention and MLP keep `tensor` for heads/mlp because those rules come first."""
    out: list[tuple[str, Candidate]] = []
    inserted = False
    for logical, candidate in rules:
        if logical == ax.LENGTH and not inserted:
            out.append((ax.LENGTH, (*mesh_axes_of(candidate), ax.TENSOR)))
            inserted = True
        out.append((logical, candidate))
    if not inserted:
        out.append((ax.LENGTH, ax.TENSOR))
    return tuple(out)


def without_axis(rules: Rules, mesh_axis: str) -> Rules:
    """The rules with `mesh_axis` removed from every candidate: for code that runs per
    slice of that axis (e.g. per data replica), where the axis is already spent."""
    out = []
    for logical, candidate in rules:
        kept = tuple(a for a in mesh_axes_of(candidate) if a != mesh_axis)
        out.append((logical, as_candidate(kept)))
    return tuple(out)


def _canonical(candidate) -> Candidate:
    if candidate is None or candidate == "" or candidate == []:
        return None
    names = [candidate] if isinstance(candidate, str) else list(candidate)
    for name in names:
        require(isinstance(name, str) and name.lower() in ax.MESH_AXIS_ALIASES,
                f"rule names unknown mesh axis {name!r}; use one of {', '.join(ax.MESH_AXES)}")
    canon = tuple(ax.MESH_AXIS_ALIASES[n.lower()] for n in names)
    return as_candidate(canon)


def load_rules(path: str | Path, base: Rules = DEFAULT_RULES) -> Rules:
    """Rules from a TOML file: a `[rules]` table mapping each logical name to its candidates
    in priority order, e.g. `embed = ["tensor"]`, `batch = [["data", "fsdp"]]`, `mlp = []`."""
    path = Path(path)
    require(path.is_file(), f"rules file {str(path)!r} does not exist; pass an existing TOML file")
    try:
        table = tomllib.loads(path.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(
            f"rules file {str(path)!r} is not valid TOML ({e}); fix the file") from None
    rules = table.get("rules")
    require(isinstance(rules, dict),
            f"rules file {str(path)!r} has no [rules] table; add one, e.g. "
            '[rules] embed = ["fsdp"]')
    for logical, candidates in rules.items():
        # A rule for a name no tensor carries would silently change nothing.
        near = difflib.get_close_matches(logical, ax.LOGICAL_AXES, n=1)
        require(logical in ax.LOGICAL_AXES,
                f"rules file {str(path)!r} names unknown logical axis {logical!r}; "
                + (f"did you mean {near[0]!r}? " if near else "")
                + f"use one of {', '.join(ax.LOGICAL_AXES)}")
        require(isinstance(candidates, list),
                f"rule {logical!r} in {str(path)!r} must be a list of mesh axes, e.g. [\"tensor\"]")
    return override(base, rules)


# --- activation sharding constraints ------------------------------------------------------------


def constrainer(mesh, rules: Rules):
    """`constrain(x, names)`: pin activation `x` to the sharding its logical `names` resolve
    to on `mesh` (what a step hands the model as `ModelContext.constrain`)."""
    import jax
    from jax.sharding import NamedSharding

    def constrain(x, names: Sequence[str | None]):
        # Inside a shard_map the constraint names the current (partly manual) abstract mesh.
        current = jax.sharding.get_abstract_mesh()
        where = mesh if current.empty else current
        spec = resolve(names, rules, mesh)
        return jax.lax.with_sharding_constraint(x, NamedSharding(where, spec))
    return constrain

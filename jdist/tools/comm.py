"""Which collectives a compiled step runs, over which mesh axes, how many bytes they move and
how long they should take on the topology's links (`jdist.spmd.mesh.Links`).

Every collective of the compiled HLO text is read with its result bytes per device (the
convention of `jdist.tools.hlo`), its device groups and how often a step executes it (loop trip
counts multiplying). Its groups name the mesh axes it communicates over: the axes along
which the members of a group differ. The predicted time is the standard ring algorithm's
over the slowest link those axes cross; `transfer_time` is a pure function so that a
parallelism planner can cost a layout without compiling it.
"""

from __future__ import annotations

import dataclasses

from jdist.spmd.mesh import Link, Links, links_for
from jdist.tools import hlo

# Per kind, for a ring of n devices: the multiple of the result bytes each device sends over
# its link, and the number of sequential steps (each pays the link's latency once). An
# all-reduce is a reduce-scatter then an all-gather of the full buffer; a reduce-scatter's
# result is one shard, of which each device sends n-1; a permute sends its buffer once.
RING = {
    "all-reduce": lambda n: (2 * (n - 1) / n, 2 * (n - 1)),
    "all-gather": lambda n: ((n - 1) / n, n - 1),
    "reduce-scatter": lambda n: (n - 1, n - 1),
    "all-to-all": lambda n: ((n - 1) / n, n - 1),
    "collective-permute": lambda n: (1, 1) if n > 1 else (0, 0),
}


def transfer_time(kind: str, nbytes: float, group_size: int, link: Link) -> float:
    """Seconds one `kind` collective with `nbytes` result bytes per device takes within
    groups of `group_size` devices on `link` (bandwidth term plus latency per step)."""
    volume, steps = RING[kind](group_size)
    return volume * nbytes / (link.gbps * 1e9) + steps * link.latency_us * 1e-6


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective instruction: result bytes per device per execution, its device groups
    (positions in the compiled device assignment) and its executions per step."""

    kind: str
    bytes: int
    groups: tuple[tuple[int, ...], ...]
    times: int


def collectives(hlo_text: str, n_devices: int) -> list[Collective]:
    """Every collective of compiled HLO text (async pairs once, by their `-start`)."""
    return [Collective(kind, hlo.type_bytes(result), tuple(hlo.device_groups(rest, n_devices)),
                       times) for kind, result, rest, times in hlo.executed_collectives(hlo_text)]


def axes_of(groups, mesh) -> tuple[str, ...]:
    """The mesh axes along which members of a group differ, in mesh order; () when no group
    has two members (nothing moves). A jitted step's device assignment is
    `mesh.devices.flat`, so HLO position p sits at the mesh coordinate of flat index p."""
    import numpy as np

    coords = np.stack(np.unravel_index(np.arange(mesh.devices.size), mesh.devices.shape), 1)
    varying = np.zeros(len(mesh.axis_names), bool)
    for group in groups:
        members = coords[list(group)]
        varying |= (members != members[0]).any(axis=0)
    return tuple(name for name, v in zip(mesh.axis_names, varying) if v)


@dataclasses.dataclass
class Row:
    """The collectives of one kind over one set of mesh axes, per step and per device."""

    kind: str
    axes: tuple[str, ...]
    count: int = 0
    bytes: int = 0
    seconds: float = 0.0


@dataclasses.dataclass
class Report:
    rows: list[Row]

    def total(self) -> Row:
        return Row("total", (), sum(r.count for r in self.rows), sum(r.bytes for r in self.rows),
                   sum(r.seconds for r in self.rows))

    def bytes_by_kind(self) -> dict[str, int]:
        out = dict.fromkeys(hlo.COLLECTIVES, 0)
        for r in self.rows:
            out[r.kind] += r.bytes
        return out

    def as_dict(self) -> dict:
        as_json = lambda r: {**dataclasses.asdict(r), "axes": list(r.axes)}
        return {"rows": [as_json(r) for r in self.rows], "total": as_json(self.total())}


def report(hlo_text: str, mesh, links: Links | None = None) -> Report:
    """The communication of one step of compiled HLO text on `mesh`, priced on `links`
    (default: `jdist.spmd.mesh`'s defaults, nothing across hosts). Collectives whose groups are
    single devices stay in (their bytes are in the HLO) under axes () at zero time."""
    links = links or Links()
    rows: dict[tuple[str, tuple[str, ...]], Row] = {}
    for c in collectives(hlo_text, mesh.devices.size):
        axes = axes_of(c.groups, mesh)
        row = rows.setdefault((c.kind, axes), Row(c.kind, axes))
        n = max((len(g) for g in c.groups), default=1) if axes else 1
        row.count += c.times
        row.bytes += c.times * c.bytes
        row.seconds += c.times * transfer_time(c.kind, c.bytes, n, links.over(axes))
    order = {kind: i for i, kind in enumerate(hlo.COLLECTIVES)}
    return Report(sorted(rows.values(), key=lambda r: (order[r.kind], r.axes)))


def step_report(compiled, mesh_text: str, mesh) -> Report:
    """The report of a compiled step on `mesh`, priced on the links of its `--mesh`."""
    return report(compiled.as_text(), mesh, links_for(mesh_text, mesh))


def comm_table(rep: Report) -> str:
    """One line per collective kind and mesh axes: executions, MiB and predicted ms per
    step per device, then the total."""
    lines = ["communication per step, per device (ring algorithms on the mesh's links)",
             f"{'collective':20} {'mesh axes':22} {'count':>7} {'MiB':>11} {'predicted ms':>13}"]
    for r in (*rep.rows, rep.total()):
        axes = ",".join(r.axes) or ("-" if r.kind != "total" else "")
        lines.append(f"{r.kind:20} {axes:22} {r.count:7d} {r.bytes / 2**20:11.3f} "
                     f"{r.seconds * 1e3:13.3f}")
    return "\n".join(lines)

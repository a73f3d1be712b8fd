"""Re-planning a layout for the hosts left: the same model and global batch on fewer devices.

The model axes (stage, sequence, expert, tensor) decide how one replica of the model is
split, so they stay; the replica axes (data, then fsdp) shrink to what the devices left
hold, and gradient accumulation absorbs the smaller per-step batch: every device keeps its
micro-batch, so the step's memory per device changes only by fsdp's share of the state.
A pure function of sizes and counts (the launcher imports no JAX and no planner: the
training processes check the memory fit of what they are given, `jdist.train.fit`).
"""

from __future__ import annotations

import dataclasses
import math

from jdist.errors import ConfigError, require
from jdist.spmd.axes import DATA, FSDP, MESH_AXES, REPLICA_AXES, SHORT
from jdist.spmd.mesh import dcn_sizes, mesh_text


@dataclasses.dataclass(frozen=True)
class Layout:
    """Resolved axis sizes (every canonical axis), micro-batches per step, and hosts used."""

    sizes: dict[str, int]
    grad_accum: int
    hosts: int

    def mesh(self) -> str:
        """The `--mesh` argument, its axes of size one left out."""
        return mesh_text(self.sizes)

    def n_devices(self) -> int:
        return math.prod(self.sizes.values())


def largest_divisor_up_to(n: int, limit: int) -> int:
    return max(d for d in range(1, min(n, limit) + 1) if n % d == 0)


def shrink(original: Layout, hosts: int, per_host: int) -> Layout | None:
    """`original` on `hosts` hosts of `per_host` devices each, or None when it cannot be.
    fsdp keeps as much of its size as divides the replicas left (its shards are what keeps
    the state small); data takes the rest."""
    model = math.prod(n for axis, n in original.sizes.items() if axis not in REPLICA_AXES)
    devices = hosts * per_host
    replicas = math.prod(original.sizes[axis] for axis in REPLICA_AXES)
    if devices % model or (replicas * original.grad_accum) % (devices // model):
        return None
    ways = devices // model
    fsdp = largest_divisor_up_to(ways, original.sizes[FSDP])
    sizes = {**original.sizes, DATA: ways // fsdp, FSDP: fsdp}
    try:
        dcn_sizes(sizes, {}, hosts)  # every axis must split over the hosts it spans
    except ConfigError:
        return None
    return Layout(sizes, replicas * original.grad_accum // ways, hosts)


def replan(original: Layout, hosts_left: int, per_host: int) -> Layout:
    """The layout on the most of `hosts_left` hosts that can hold `original`'s model axes
    and split its batch into micro-batches of the same size (some hosts may stay idle).
    ConfigError, in one line, when no host is left or none of the counts fits."""
    gone = "the only host is" if original.hosts == 1 else f"all {original.hosts} hosts are"
    require(hosts_left >= 1, f"no devices left: {gone} excluded; bring a host back (list it "
            "in --hosts-file) and rerun with --resume auto")
    for hosts in range(min(hosts_left, original.hosts), 0, -1):
        layout = shrink(original, hosts, per_host)
        if layout is not None:
            return layout
    model = {axis: n for axis, n in original.sizes.items() if axis not in REPLICA_AXES and n > 1}
    left, need = hosts_left * per_host, math.prod(model.values())
    what = ",".join(f"{SHORT[axis]}={n}" for axis, n in model.items())
    require(need <= left, f"the plan no longer fits: its model axes {what} need {need} devices "
            f"but {left} are left ({hosts_left} host{'s' * (hosts_left > 1)} of {per_host}); "
            "bring hosts back or restart with a smaller --mesh")
    micro = math.prod(original.sizes[a] for a in REPLICA_AXES) * original.grad_accum
    raise ConfigError(f"the plan no longer fits: its {micro} per-device micro-batches a step "
                      f"do not split evenly over the devices 1 to {hosts_left} hosts of "
                      f"{per_host} leave for data parallelism; bring hosts back or use a "
                      "--batch-size (and --grad-accum) divisible by more device counts")


def original_layout(mesh_sizes: dict[str, int], grad_accum: int, hosts: int) -> Layout:
    return Layout({axis: mesh_sizes.get(axis, 1) for axis in MESH_AXES}, grad_accum, hosts)

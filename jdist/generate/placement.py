"""Where generation keeps the weights on an fsdp mesh. Training shards them over `fsdp`
and gathers each layer as it runs; decoding would then gather every weight once per token,
for one token's worth of arithmetic. So a mesh's fsdp axis replicates the weights when a
device can hold them (the batch still splits over it, as over `data`), and keeps them
sharded, gathered each step, only when it cannot. Measured in docs/measurements.md
("Generation over fsdp").
"""

from __future__ import annotations

import os

from jdist.generate.weights import inference_plan
from jdist.models import ModelConfig
from jdist.spmd import axes as ax
from jdist.spmd.rules import DEFAULT_RULES, Rules, override
from jdist.spmd.sharding import per_device_bytes

# Of a device's memory, the replicated weights may take this share; the rest is for the
# KV cache and the step's activations.
WEIGHTS_SHARE = 0.5


def device_bytes(mesh) -> int:
    """What one device of `mesh` may allocate: the accelerator's limit, or for CPU devices
    (simulated ones share the host) the host's memory split over them."""
    stats = mesh.devices.flat[0].memory_stats() or {}
    if "bytes_limit" in stats:
        return int(stats["bytes_limit"])
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // mesh.devices.size


def replicated_rules(rules: Rules = DEFAULT_RULES) -> Rules:
    """`rules` with the parameters' model dimension on no mesh axis: no weight is split over
    `fsdp` (tensor and expert splits stay)."""
    return override(rules, {ax.EMBED: []})


def generation_rules(cfg: ModelConfig, mesh, dtype, rules: Rules = DEFAULT_RULES,
                     capacity: int | None = None) -> tuple[Rules, str]:
    """(the rules generation lays the weights out by, a line saying what was decided): the
    weights replicated over `fsdp` if they take at most WEIGHTS_SHARE of `capacity` (a
    device's memory, `device_bytes`) that way, else sharded as `rules` shard them."""
    if mesh.shape.get(ax.FSDP, 1) == 1:
        return rules, ""
    whole = replicated_rules(rules)
    plan = inference_plan(cfg, mesh, whole, dtype)
    need = per_device_bytes(plan.abstract.params, plan.shardings.params)
    capacity = capacity or device_bytes(mesh)
    size = f"{need / 2**20:,.1f} MiB of weights per device, of {capacity / 2**20:,.0f} MiB"
    if need <= WEIGHTS_SHARE * capacity:
        return whole, f"weights replicated over fsdp ({size}): no gathers while decoding"
    return rules, (f"weights stay sharded over fsdp (replicated: {size}, over "
                   f"{WEIGHTS_SHARE:.0%}): each token gathers them; fewer fsdp ways decode faster")

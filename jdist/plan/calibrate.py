"""`python -m jdist.plan calibrate`: measure the `cpu-sim` profile on this machine.

On the simulated CPU devices of one process it times, with every device busy at once (the
cores are shared, so per-device numbers are what a training step on all of them sees):
- float32 matmuls of an MLP's shape, `(x @ w_up) @ w_down`, at the `small` model's step size
  and larger: FLOP/s per device, step-sized and peak;
- a large elementwise op: memory bandwidth per device;
- every collective kind of `jdist.tools.comm.RING` inside `jax.shard_map` over groups of 2, 4 and 8
  consecutive devices (all groups at once) at 4 KiB to 16 MiB per device, then a
  least-squares fit of the ring model `time = volume * bytes / bandwidth + steps * latency`
  over all kinds (the ICI link) and per kind (`ici_by_kind`, which `Profile.link(kind)`
  prefers: on simulated devices a ppermute synchronises every device of the mesh, so its
  per-step latency is several times the others').

Each measurement is a jitted loop whose trip count is an argument, so one compilation times
both 1 and 1 + L iterations; their difference over L is one iteration without the dispatch
and synchronisation a call pays. The median over interleaved repeats resists a loaded
machine. The result is a TOML file (`jdist.plan.profiles.calibration_path()`) with the date,
jax version, device count and every raw measurement. It takes about a minute on two quiet
cores (two under load).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import re
import statistics
import sys
import time
from pathlib import Path

from jdist.errors import require, run_cli
from jdist.files import write_atomically
from jdist.tools.comm import RING

KiB, MiB = 1 << 10, 1 << 20
# Per-device buffer sizes of the collectives (the larger of input and result), x8 apart.
COLLECTIVE_BYTES = (4 * KiB, 32 * KiB, 256 * KiB, 2 * MiB, 16 * MiB)
GROUPS = (2, 4, 8)
# Rows per device, d_model, hidden. `small` (d_model 256, d_ff 768) at 2048 and 4096 tokens
# per step over 8 devices is 256 and 512 rows each; the large one shows the peak.
MATMULS = {"step-2k": (256, 256, 768), "step-4k": (512, 256, 768),
           "large": (1024, 512, 1024)}
STEP_MATMUL = "step-4k"
# (global batch, sequence) of the two `small` training steps on dp=n (see measure_steps).
STEP_BATCHES = ((8, 256), (24, 256))
MEMORY_BYTES = 32 * MiB  # per device: eight of them are 8x the 32 MiB L3 of the dev machine
REPEATS = 7
TARGET_S = 0.05  # the long run lasts about this much longer than the short one
# Per-kind fits this many times faster or slower than the joint one are reported as different.
DIFFERS = 2.0


def calibrate(n_devices: int = 8, *, matmuls: dict = MATMULS, memory_bytes: int = MEMORY_BYTES,
              collective_bytes=COLLECTIVE_BYTES, groups=GROUPS, kinds=tuple(RING),
              repeats: int = REPEATS, target_s: float = TARGET_S,
              step_model: bool = True) -> dict:
    """Measure the first `n_devices` devices (simulated CPU devices: the caller has set
    `jax_num_cpu_devices`). Returns the calibration as a dict that `write_calibration`
    stores and `load_profile("cpu-sim")` reads (its `profile` and `ici_by_kind` tables)."""
    import jax

    cpus = jax.devices("cpu")  # cpu-sim's devices, even where an accelerator is the default
    devices = cpus[:n_devices]
    require(len(devices) == n_devices,
            f"calibrate needs {n_devices} CPU devices but jax has {len(cpus)}; run `python -m "
            f"jdist.plan calibrate --devices {n_devices}` in a fresh process (the count is "
            "fixed once jax initialises)")
    timer = dict(repeats=repeats, target_s=target_s)
    mm, mm_s = timed(lambda: [measure_matmul(devices, name, shape, **timer)
                              for name, shape in matmuls.items()])
    mem, mem_s = timed(lambda: measure_memory(devices, memory_bytes, **timer))
    coll, coll_s = timed(lambda: [measure_collective(devices, kind, g, nbytes, **timer)
                                  for kind in kinds for g in groups
                                  if 1 < g <= n_devices and n_devices % g == 0
                                  for nbytes in collective_bytes])
    fits = fit_all(coll)
    step, step_s = timed(lambda: measure_steps(n_devices)) if step_model else (None, 0.0)
    fields = profile_fields(mm, mem, fits, n_devices)
    if step is not None:  # a real step's rate stands for the step's compute
        fields["matmul_efficiency"] = min(1.0, step["tflops_per_device"] / fields["peak_tflops"])
        fields["step_overhead_ms"] = step["overhead_ms"]
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "jax_version": jax.__version__,
        "platform": devices[0].platform,
        "n_devices": n_devices,
        "cpu_count": os.cpu_count() or 0,
        "load_average": list(os.getloadavg()),  # other work on the cores skews everything
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "seconds": mm_s + mem_s + coll_s + step_s,
        "phase_seconds": {"matmul": mm_s, "memory": mem_s, "collectives": coll_s,
                          "step": step_s},
        "profile": fields,
        "fit": {"rms_relative_error": fits["all"]["rms_relative_error"],
                "points": fits["all"]["points"], "per_kind_differs": per_kind_differs(fits)},
        "ici_by_kind": {k: v for k, v in fits.items() if k != "all"},
        "raw": {"matmul": mm, "memory": mem, "collectives": coll,
                **({"step": step} if step else {})},
    }


def profile_fields(matmuls: list[dict], memory: dict, fits: dict, n_devices: int) -> dict:
    """The Profile fields measured: the peak is the fastest matmul, the efficiency what the
    step-sized one reaches of it (so `achievable_flops` is the step-sized rate)."""
    step = next((m for m in matmuls if m["name"] == STEP_MATMUL), matmuls[0])
    peak = max(m["tflops_per_device"] for m in matmuls)
    return {
        "peak_tflops": peak,
        "matmul_efficiency": min(1.0, step["tflops_per_device"] / peak),
        "memory_gb": host_memory_bytes() / n_devices / 1e9,  # the devices share the RAM
        "memory_gbps": memory["gbps_per_device"],
        # Offloading to host memory on the CPU copies within the same RAM: the same traffic
        # (read one buffer, write another) as the elementwise op measured.
        "host_gbps": memory["gbps_per_device"],
        "ici_gbps": fits["all"]["gbps"],
        "ici_latency_us": fits["all"]["latency_us"],
        "devices_per_host": n_devices,
    }


def measure_step(n_devices: int, batch_size: int = 8, seq_len: int = 256,
                 steps: int = 5) -> dict:
    """A real training step of `small` on dp=n_devices (float32, remat none): its median
    time and the FLOPs per device it executes by the planner's count
    (`jdist.plan.cost.executed_flops`)."""
    import jax
    import jax.numpy as jnp

    from jdist.config import TrainConfig
    from jdist.memory import compile_step
    from jdist.plan.cost import executed_flops
    from jdist.step import init_state
    from jdist.step.forward import attention_of
    from jdist.step.from_flags import plan_for

    config = TrainConfig.of(model="small", mesh=f"dp={n_devices}", batch_size=batch_size,
                         seq_len=seq_len, compute_dtype="float32", cpu_devices=n_devices)
    _, plan, _ = plan_for(config)
    compiled = compile_step(plan, batch_size, seq_len)
    tokens = jax.device_put(jax.random.randint(jax.random.key(0), (batch_size, seq_len), 0,
                                               plan.model.vocab_size, jnp.int32),
                            plan.batch_sharding)
    batch = {"inputs": tokens, "targets": tokens}
    state = init_state(plan, 0)
    times = []
    for _ in range(steps + 2):  # two warm-up steps
        start = time.perf_counter()
        state, metrics = compiled(state, batch)
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - start)
    flops = executed_flops(plan.model, seq_len, batch_size * seq_len / n_devices,
                           attention_of(plan, seq_len), plan.compute.remat, False,
                           plan.compute.loss, 1)
    return {"model": "small", "mesh": config.parallel.mesh, "batch_size": batch_size,
            "seq_len": seq_len, "seconds": statistics.median(times[2:]),
            "flops_per_device": flops}


def measure_steps(n_devices: int, batches=STEP_BATCHES) -> dict:
    """Two step sizes of `small` on dp=n_devices: the slope is what a step's FLOPs cost
    (FLOP/s per device a whole step reaches: its small attention matmuls, elementwise work
    and per-operation costs included), the intercept what a step costs whatever its size
    (dispatch, per-operation overhead of the runtime). The planner's validation
    (`benchmarks/planner.py`, 16 x 256 tokens) lies between the two, measured apart."""
    small, large = (measure_step(n_devices, b, seq) for b, seq in batches)
    rate = (large["flops_per_device"] - small["flops_per_device"]) / positive(
        large["seconds"] - small["seconds"])
    overhead = max(0.0, small["seconds"] - small["flops_per_device"] / rate)
    return {"steps": [small, large], "tflops_per_device": rate / 1e12,
            "overhead_ms": overhead * 1e3}


# --- timing -------------------------------------------------------------------------------

def timed(thunk):
    """(thunk(), seconds it took)."""
    start = time.perf_counter()
    return thunk(), time.perf_counter() - start


def _wall(fn, args, iterations: int) -> float:
    import jax
    import jax.numpy as jnp

    start = time.perf_counter()
    jax.block_until_ready(fn(*args, jnp.int32(iterations)))
    return time.perf_counter() - start


def time_iteration(fn, args, repeats: int, target_s: float) -> tuple[float, int]:
    """Seconds of one loop iteration of `fn(*args, iterations)`, and the L it was timed
    with: the median over `repeats` of (t(1 + L) - t(1)) / L, L chosen from a probe so the
    difference lasts about `target_s` (at least 2 iterations)."""
    _wall(fn, args, 1)  # compile and warm up
    extra = max(2, math.ceil(target_s / probe_iteration(fn, args, target_s)))
    diffs = []
    for _ in range(repeats):  # interleaved, so a burst of load hits both runs of a pair
        short = _wall(fn, args, 1)
        diffs.append((_wall(fn, args, 1 + extra) - short) / extra)
    return statistics.median(diffs), extra


def probe_iteration(fn, args, target_s: float, probe: int = 8) -> float:
    """A rough time of one iteration, to size the timed runs: one run when that alone
    lasts `target_s` (dispatch is then negligible), else from the difference of two runs
    or (when noise made it non-positive) from the longer run with its dispatch."""
    short = _wall(fn, args, 1)
    if short >= target_s:
        return short
    long = _wall(fn, args, 1 + probe)
    per_iteration = (long - short) / probe if long > short else long / (1 + probe)
    return max(per_iteration, 1e-6)


def looped(body):
    """`f(x, *consts, iterations)`: `body(x, *consts)` applied `iterations` times (a while
    loop: the trip count is an argument, so one compilation serves every count)."""
    from jax import lax

    def run(x, *rest):
        *consts, iterations = rest
        return lax.fori_loop(0, iterations, lambda i, c: body(c, *consts), x)
    return run


# --- compute and memory -------------------------------------------------------------------

def matmul_fn(mesh, shape):
    """The MLP pair `(x @ w_up) @ w_down` per device, rows sharded over `mesh`'s one axis."""
    import jax
    from jax.sharding import PartitionSpec as P

    body = looped(lambda x, up, down: (x @ up) @ down)
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("d"), P(), P(), P()),
                                 out_specs=P("d")))


def measure_matmul(devices, name: str, shape, *, repeats: int, target_s: float) -> dict:
    """float32 FLOP/s per device of `rows x d @ d x hidden @ hidden x d` on every device."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    rows, d, hidden = shape
    mesh = Mesh(devices, ("d",))
    # Zeros: no denormals, and the values stay bounded however many iterations run.
    x = jax.device_put(jnp.zeros((len(devices) * rows, d), jnp.float32),
                       NamedSharding(mesh, P("d")))
    up, down = jnp.zeros((d, hidden), jnp.float32), jnp.zeros((hidden, d), jnp.float32)
    seconds, iterations = time_iteration(matmul_fn(mesh, shape), (x, up, down), repeats,
                                         target_s)
    flops = 2 * 2 * rows * d * hidden
    return {"name": name, "rows": rows, "d": d, "hidden": hidden, "flops_per_device": flops,
            "seconds": seconds, "iterations": iterations,
            "tflops_per_device": flops / positive(seconds) / 1e12}


def measure_memory(devices, nbytes: int, *, repeats: int, target_s: float) -> dict:
    """Bytes per second per device of `x * a + b` over `nbytes` per device (read + write)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(devices, ("d",))
    fn = jax.jit(jax.shard_map(looped(lambda x: x * 1.0001 + 1.0), mesh=mesh,
                               in_specs=(P("d"), P()), out_specs=P("d")))
    x = jax.device_put(jnp.zeros(len(devices) * (nbytes // 4), jnp.float32),
                       NamedSharding(mesh, P("d")))
    seconds, iterations = time_iteration(fn, (x,), repeats, target_s)
    return {"bytes_per_device": nbytes, "seconds": seconds, "iterations": iterations,
            "gbps_per_device": 2 * nbytes / positive(seconds) / 1e9}


def host_memory_bytes() -> float:
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def positive(seconds: float) -> float:
    """A time that noise made zero or negative, as the smallest that can be divided by."""
    return max(seconds, 1e-12)


# --- collectives ----------------------------------------------------------------------------

def collective_body(kind: str, group: int, n: int):
    """(body, result elements): one `kind` collective over mesh axis "g" as a loop body
    whose carry keeps its shape and depends on the collective (so nothing is hoisted out of
    the loop), `n` float32 elements per device being the larger of its input and result."""
    from jax import lax

    if kind == "all-reduce":
        return (lambda c: lax.psum(c, "g")), n
    if kind == "all-gather":  # gather a 1/group slice of the carry back to its full size
        return (lambda c: lax.all_gather(c[: n // group], "g", tiled=True)), n
    if kind == "reduce-scatter":  # the result (1/group) is written over the carry's head
        scatter = lambda c: lax.psum_scatter(c, "g", scatter_dimension=0, tiled=True)
        return (lambda c: lax.dynamic_update_slice(c, scatter(c), (0,))), n // group
    if kind == "all-to-all":
        return (lambda c: lax.all_to_all(c, "g", 0, 0, tiled=True)), n
    if kind == "collective-permute":  # a ring shift within each group
        perm = [(i, (i + 1) % group) for i in range(group)]
        return (lambda c: lax.ppermute(c, "g", perm)), n
    raise ValueError(f"unknown collective kind {kind!r}; use one of {', '.join(RING)}")


def collective_fn(devices, kind: str, group: int, nbytes: int):
    """(jitted loop, its input, result bytes per device): `kind` over groups of `group`
    consecutive devices, every group at once, `nbytes` per device."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.asarray(devices).reshape(len(devices) // group, group), ("r", "g"))
    n = nbytes // 4 // group * group
    body, result = collective_body(kind, group, n)
    spec = P(("r", "g"))
    # check_vma off: a psum's result is invariant over "g", the loop carry was varying.
    fn = jax.jit(jax.shard_map(looped(body), mesh=mesh, in_specs=(spec, P()), out_specs=spec,
                               check_vma=False))
    x = jax.device_put(jnp.zeros(len(devices) * n, jnp.float32), NamedSharding(mesh, spec))
    return fn, x, result * 4


def measure_collective(devices, kind: str, group: int, nbytes: int, *, repeats: int,
                       target_s: float) -> dict:
    fn, x, result_bytes = collective_fn(devices, kind, group, nbytes)
    seconds, iterations = time_iteration(fn, (x,), repeats, target_s)
    return {"kind": kind, "group": group, "buffer_bytes": nbytes, "result_bytes": result_bytes,
            "seconds": seconds, "iterations": iterations}


def fit_ring(points) -> dict:
    """Bandwidth (GB/s) and latency (us per step) of `jdist.tools.comm.RING`'s model over
    measurements `{kind, group, result_bytes, seconds}`, by least squares on the relative
    error (absolute errors would let the 16 MiB points decide alone and leave the latency
    to noise). Points noise made non-positive are left out. A fit that would need a
    negative latency or bandwidth falls back to bandwidth alone (latency 0)."""
    import numpy as np

    rows = []
    for p in points:
        volume, steps = RING[p["kind"]](p["group"])
        if p["seconds"] > 0 and volume > 0:
            rows.append((volume * p["result_bytes"] / p["seconds"], steps / p["seconds"]))
    require(len(rows) >= 2, "too few positive collective timings to fit; rerun calibrate "
                            "on a quieter machine")
    a = np.asarray(rows)
    (per_byte, per_step), *_ = np.linalg.lstsq(a, np.ones(len(a)), rcond=None)
    method = "least-squares"
    if per_byte <= 0 or per_step < 0:
        per_byte, per_step, method = a[:, 0].sum() / (a[:, 0] ** 2).sum(), 0.0, "bandwidth-only"
    residual = a @ np.array([per_byte, per_step]) - 1
    return {"gbps": float(1 / per_byte / 1e9), "latency_us": float(per_step * 1e6),
            "rms_relative_error": float(np.sqrt(np.mean(residual ** 2))), "points": len(a),
            "method": method}


def fit_all(points: list[dict]) -> dict:
    """The joint fit ("all") and one per kind measured."""
    kinds = sorted({p["kind"] for p in points}, key=list(RING).index)
    return {"all": fit_ring(points),
            **{k: fit_ring([p for p in points if p["kind"] == k]) for k in kinds}}


def per_kind_differs(fits: dict) -> bool:
    """Whether some kind's bandwidth or latency is more than DIFFERS times off the joint
    fit's (then the planner should price kinds by `Profile.link(kind)`)."""
    joint = fits["all"]
    ratio = lambda a, b: max(a, b) / max(min(a, b), 1e-12)
    return any(ratio(f["gbps"], joint["gbps"]) > DIFFERS
               or ratio(f["latency_us"], joint["latency_us"]) > DIFFERS
               for k, f in fits.items() if k != "all")


# --- the file -------------------------------------------------------------------------------

BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")


def toml_key(key: str) -> str:
    return key if BARE_KEY.fullmatch(key) else json.dumps(key)


def toml_value(value) -> str:
    """One TOML value: strings (JSON escapes are TOML's), booleans, numbers (inf/nan as
    TOML spells them), lists (of dicts: one inline table per line), dicts inline."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        value = float(value)  # numpy's float64 is a float whose repr is not TOML
        if math.isnan(value):
            return "nan"
        return repr(value) if math.isfinite(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, dict):
        return "{" + ", ".join(f"{toml_key(k)} = {toml_value(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list | tuple):
        if any(isinstance(v, dict) for v in value):
            return "[\n" + "".join(f"  {toml_value(v)},\n" for v in value) + "]"
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if hasattr(value, "item"):  # a numpy scalar
        return toml_value(value.item())
    raise TypeError(f"cannot write {type(value).__name__} {value!r} as TOML")


def to_toml(table: dict, path: tuple[str, ...] = ()) -> str:
    """A dict as TOML: its plain values, then each sub-dict as a `[table]` (recursively)."""
    plain = {k: v for k, v in table.items() if not isinstance(v, dict)}
    nested = {k: v for k, v in table.items() if isinstance(v, dict)}
    lines = [f"[{'.'.join(toml_key(k) for k in path)}]"] if path and (plain or not nested) else []
    lines += [f"{toml_key(k)} = {toml_value(v)}" for k, v in plain.items()]
    text = "\n".join(lines) + "\n" if lines else ""
    for key, sub in nested.items():
        text += "\n" + to_toml(sub, (*path, key))
    return text


HEADER = """\
# Calibration of the cpu-sim accelerator profile, written by `python -m jdist.plan calibrate`.
# load_profile("cpu-sim") reads [profile] and [ici_by_kind.*] over jdist/plan/profiles.toml.
# Per device, all devices busy at once; seconds per operation; bytes per device (result
# bytes for collectives, as jdist.tools.comm counts them). Rerun to refresh; delete to use defaults.
"""


def write_calibration(result: dict, path) -> Path:
    """Write `result` (a `calibrate` dict) as TOML at `path`, creating its directory."""
    path = Path(path).expanduser()
    path.parent.mkdir(parents=True, exist_ok=True)
    return write_atomically(path, HEADER + "\n" + to_toml(result))


# --- the command ---------------------------------------------------------------------------

def summary(result: dict, path) -> str:
    """What was measured, in a few lines, and where it went."""
    p, raw = result["profile"], result["raw"]
    lines = [f"cpu-sim calibration: {result['n_devices']} {result['platform']} devices, "
             f"{result['cpu_count']} cores, jax {result['jax_version']}, "
             f"{result['seconds']:.0f} s (load average {result['load_average'][0]:.1f})"]
    for m in raw["matmul"]:
        lines.append(f"  matmul {m['name']:10} {m['rows']}x{m['d']} @ {m['d']}x{m['hidden']} "
                     f"@ {m['hidden']}x{m['d']}: {m['tflops_per_device'] * 1e3:8.2f} "
                     "GFLOP/s per device")
    if "step" in raw:
        st = raw["step"]
        for one in st["steps"]:
            lines.append(f"  training step {one['model']} {one['mesh']} {one['batch_size']}x"
                         f"{one['seq_len']}: {one['seconds'] * 1e3:.0f} ms")
        lines.append(f"  a step's FLOPs run at {st['tflops_per_device'] * 1e3:.2f} GFLOP/s per "
                     f"device (matmul_efficiency {p['matmul_efficiency']:.3f}), plus "
                     f"{st['overhead_ms']:.0f} ms per step")
    mem = raw["memory"]
    lines.append(f"  memory {mem['bytes_per_device'] / MiB:.0f} MiB elementwise: "
                 f"{mem['gbps_per_device']:.2f} GB/s per device")
    lines.append(f"  {'collective':20} {'GB/s':>9} {'latency us':>11} {'rms rel err':>12}")
    fits = {"all": {"gbps": p["ici_gbps"], "latency_us": p["ici_latency_us"],
                    "rms_relative_error": result["fit"]["rms_relative_error"]},
            **result["ici_by_kind"]}
    for kind, f in fits.items():
        lines.append(f"  {kind:20} {f['gbps']:9.3f} {f['latency_us']:11.1f} "
                     f"{f['rms_relative_error']:12.2f}")
    if result["fit"]["per_kind_differs"]:
        lines.append(f"  per-kind fits differ over {DIFFERS:g}x from the joint one: "
                     "Profile.link(kind) uses them")
    lines.append(f"written to {path}")
    return "\n".join(lines)


def parse_args(argv):
    from jdist.plan.profiles import calibration_path

    parser = argparse.ArgumentParser(prog="python -m jdist.plan calibrate",
                                     description="Measure the cpu-sim profile on this machine.")
    parser.add_argument("--out", type=Path, default=None,
                        help="calibration file (default: $JDIST_CALIBRATION, else "
                             f"{calibration_path()})")
    parser.add_argument("--devices", type=int, default=8,
                        help="simulated CPU devices to measure (default 8)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """`python -m jdist.plan calibrate [--out PATH] [--devices 8]`."""
    args = parse_args(sys.argv[1:] if argv is None else argv)

    def body() -> int:
        from jdist.plan.profiles import calibration_path

        require(args.devices >= 2, f"--devices {args.devices}: collectives need at least 2")
        from jdist.runtime.distributed import configure_devices

        configure_devices(args.devices)
        result = calibrate(args.devices)
        path = write_calibration(result, args.out or calibration_path())
        print(summary(result, path))
        return 0
    return run_cli(body)


if __name__ == "__main__":
    sys.exit(main())

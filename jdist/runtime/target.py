"""Deviceless GPU targets: compile jdist's real step for NVIDIA GPUs this machine does not have.

XLA's GPU compiler runs without a GPU when it is given a target description (a
`GpuTargetConfig`: the device's SM count, memory, caches, compute capability and the CUDA and
cuDNN versions) and a topology (`HOSTSx1xDEVICES_PER_HOST`). `jax.experimental.topologies`
then returns compile-only devices. They go through the same `build_mesh`, `plan_for` and
attention choice as real devices, and `jit(...).lower(...).compile()` on them produces the
scheduled GPU program (cuDNN attention, cuBLAS/Triton gemms, asynchronous collectives under
XLA's latency-hiding scheduler) whose memory and communication `jdist.memory` and
`jdist.tools.gpu_report` read. Nothing runs: there is nothing to run it on.

What it needs (found on jax 0.10.2 with `jax[cuda12]==0.10.2`, i.e. `pip install
".[cuda12]"`): the CUDA plugin importable; `JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1`, because the
plugin's version probe calls cuInit, which fails without a driver (error 303) and aborts the
plugin; the host backend kept on the CPU; and no autotuning (there is no device to time
kernels on), which `COMPILER_OPTIONS` passes to each compile.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import os

from jdist.errors import ConfigError, require

# What `jit(...).lower(...).compile(compiler_options=...)` needs for a compile-only GPU: the
# autotuner would time candidate kernels on a device (XLA picks by its cost model instead).
COMPILER_OPTIONS = {"xla_gpu_autotune_level": 0}

# XLA flags jdist sets on NVIDIA GPUs (compile options of the step, unless the user set
# XLA_FLAGS), by the jaxlib that accepts them; each kept because it lowers the exposed share
# of the GPU-compiled step (`benchmarks/gpu_flags.py`; see docs/measurements.md#gpu-flags).
# XLA's latency-hiding scheduler keeps one collective in flight and gives each the matmuls
# scheduled while it runs: a layer's nine weight gathers each got one matmul, the last none.
# Combined into one collective per kind and layer (up to 1 GiB; a 70B layer gathers 1.6 GiB
# at tp=1), each spans the layer's compute. Four in flight (XLA's default is one): the
# activations' tensor collectives no longer wait behind the weight gathers. `--tp-halves`
# drops the combining, which would merge the two halves' collectives back into one.
_COMBINE = {"xla_gpu_all_gather_combine_threshold_bytes": 2**30,
            "xla_gpu_reduce_scatter_combine_threshold_bytes": 2**30}
_IN_FLIGHT = {"xla_gpu_experimental_parallel_collective_overlap_limit": 4}
GPU_FLAGS = {(0, 10): _COMBINE | _IN_FLIGHT,
             (0, 12): _COMBINE | _IN_FLIGHT}  # 0.11: not compiled with here yet

# XLA's analytical latency estimator, set per step (`estimator_suits`): it hides more where
# tensor parallelism is 2 or without SP, the same without tensor parallelism, and less with
# collective matmuls over 4 or 8 devices (see docs/measurements.md#gpu-flags), whose
# collective-permutes jax 0.10.2 prices at a kernel launch ("Runtime estimate for
# collective-permute-start not implemented"). jaxlib 0.10 only: jaxlib 0.12's GPU compiler
# aborts on jdist's dense steps with it ("Check failed: buffer != nullptr", shape.h).
_ESTIMATOR = {"xla_gpu_enable_analytical_latency_estimator": True}
ESTIMATOR_FLAGS = {(0, 10): _ESTIMATOR}

# Scheduling flags measured and not set: the pipelined all-gather exposes more, the others
# about the same (`benchmarks/gpu_flags.py`; docs/measurements.md#gpu-flags, docs/gpu.md "GPU
# scheduling flags"), by the jaxlib that spells them so (newer XLA's `xla_gpu_pipeline_*` is
# "No such compile option" on jax 0.10.2).
CANDIDATE_FLAGS = {
    (0, 10): {"xla_gpu_enable_pipelined_all_gather": True,
              "xla_gpu_enable_pipelined_reduce_scatter": True,
              "xla_gpu_enable_pipelined_all_reduce": True,
              "xla_gpu_enable_while_loop_double_buffering": True},
    # jaxlib 0.12 renamed the pipeliners to an enum (`CollectivePipeliningMode`): the 0.10
    # spellings are "No such compile option" there, and `on`/`true` not a valid value.
    (0, 12): {"xla_gpu_pipeline_all_gather": "COLLECTIVE_PIPELINING_MODE_ON",
              "xla_gpu_pipeline_reduce_scatter": "COLLECTIVE_PIPELINING_MODE_ON",
              "xla_gpu_pipeline_all_reduce": "COLLECTIVE_PIPELINING_MODE_ON",
              "xla_gpu_enable_while_loop_double_buffering": True} | _ESTIMATOR,
}


def _jaxlib_version() -> tuple[int, int]:
    import jaxlib

    return tuple(int(x) for x in jaxlib.__version__.split(".")[:2])


def candidate_flags() -> dict:
    """The scheduling flags the installed jaxlib spells (empty for a version not yet
    measured: a flag is never passed to a jaxlib it was not checked on)."""
    return dict(CANDIDATE_FLAGS.get(_jaxlib_version(), {}))


def estimator_suits(collective_matmul_devices: int, pipelined: bool, experts: bool,
                    halves: bool) -> bool:
    """Whether XLA's analytical latency estimator hides more of a step whose collective
    matmuls run over this many devices (0: none) than XLA's default estimate: not over more
    than two, where it prices their transfers at a kernel launch (`_ESTIMATOR`), nor under
    `--tp-halves`, where it exposed more (docs/measurements.md#gpu-flags). Only on dense
    steps without pipeline stages, where it was measured: jax 0.10.2: with stages XLA's GPU
    compiler crashed (segmentation fault, the pp-gpipe program of tests/test_gpu_target.py),
    and it prices MoE's all-to-alls at a kernel launch too."""
    return collective_matmul_devices <= 2 and not (pipelined or experts or halves)


def gpu_flags(tp_halves: bool = False, estimator: bool = False) -> dict:
    """The flags jdist compiles a step with on NVIDIA GPUs, for the installed jaxlib (without
    the combining under `--tp-halves`; with XLA's analytical latency estimator where
    `estimator_suits` the step)."""
    version = _jaxlib_version()
    flags = dict(GPU_FLAGS.get(version, {}))
    if estimator:
        flags |= ESTIMATOR_FLAGS.get(version, {})
    return {k: v for k, v in flags.items() if k not in _COMBINE} if tp_halves else flags


CUDA_EXTRA = 'pip install -e ".[cuda12]"'  # the extra that brings jax's CUDA plugin
CUDA_VERSION = (12, 9)  # CUDA runtime of jax[cuda12] 0.10.x wheels
CUDNN_VERSION = (9, 8)  # the cuDNN those wheels require at least


@dataclasses.dataclass(frozen=True)
class Gpu:
    """One NVIDIA GPU as XLA's compiler sees it (`stream_executor.GpuDeviceInfoProto`): the
    numbers its cost model, fusion and scheduling decisions read. From the data sheets and
    what `nvidia-smi` / `cudaGetDeviceProperties` report for the SXM parts."""

    description: str       # the CUDA device name (`device_kind` of the compile-only devices)
    capability: tuple[int, int]
    core_count: int        # streaming multiprocessors
    memory_bytes: int      # what the driver reports (more than the nominal GB of the name)
    memory_bandwidth: int  # bytes per second
    l2_cache_bytes: int
    clock_ghz: float
    shared_memory_per_block_optin: int
    shared_memory_per_core: int

    def target_config(self) -> str:
        """The `GpuTargetConfig` text proto `get_topology_desc(target_config=...)` reads."""
        major, minor = self.capability
        info = {"threads_per_block_limit": 1024, "threads_per_warp": 32,
                "shared_memory_per_block": 48 * 1024,
                "shared_memory_per_core": self.shared_memory_per_core,
                "threads_per_core_limit": 2048, "core_count": self.core_count,
                "fpus_per_core": 128, "block_dim_limit_x": 2**31 - 1,
                "block_dim_limit_y": 65535, "block_dim_limit_z": 65535,
                "memory_bandwidth": self.memory_bandwidth,
                "l2_cache_size": self.l2_cache_bytes, "clock_rate_ghz": self.clock_ghz,
                "device_memory_size": self.memory_bytes,
                "shared_memory_per_block_optin": self.shared_memory_per_block_optin,
                "registers_per_core_limit": 65536, "registers_per_block_limit": 65536}
        fields = "\n".join(f"  {k}: {v}" for k, v in info.items())
        return (f"gpu_device_info {{\n{fields}\n  cuda_compute_capability {{ major: {major} "
                f"minor: {minor} }}\n}}\nplatform_name: \"CUDA\"\n"
                f"dnn_version_info {{ major: {CUDNN_VERSION[0]} minor: {CUDNN_VERSION[1]} }}\n"
                f"runtime_version {{ major: {CUDA_VERSION[0]} minor: {CUDA_VERSION[1]} }}\n"
                f"device_description_str: \"{self.description}\"\n")


# Keyed by the planner's profile names (jdist/plan/profiles.toml), whose prices they share.
GPUS = {
    "h100-80gb": Gpu("NVIDIA H100 80GB HBM3", (9, 0), 132, 84_929_347_584, 3_352_320_000_000,
                     50 * 2**20, 1.98, 232_448, 233_472),
    "h200-141gb": Gpu("NVIDIA H200", (9, 0), 132, 150_754_820_096, 4_800_000_000_000,
                      50 * 2**20, 1.98, 232_448, 233_472),
    "a100-80gb": Gpu("NVIDIA A100-SXM4-80GB", (8, 0), 108, 85_198_045_184, 2_039_000_000_000,
                     40 * 2**20, 1.41, 166_912, 167_936),
}
CAPABILITY = {gpu.description: gpu.capability for gpu in GPUS.values()}


def gpu_of(name: str) -> Gpu:
    require(name in GPUS, f"unknown --target {name!r}; use one of {', '.join(GPUS)}")
    return GPUS[name]


def plugin_installed() -> bool:
    return importlib.util.find_spec("jax_plugins") is not None and \
        importlib.util.find_spec("jax_plugins.xla_cuda12") is not None


def check_plugin() -> None:
    """One line naming the extra to install when jax's CUDA plugin is missing."""
    if not plugin_installed():
        raise ConfigError("compiling for a GPU target needs jax's CUDA plugin, which is not "
                          f"installed; run {CUDA_EXTRA}")


def prepare_host() -> None:
    """Let jax's CUDA plugin load for a compile-only topology on a machine without a GPU
    (importing `jdist` already keeps jax's own devices on the CPU there). The plugin reads
    the variable when it first loads, which on the CPU platform is at the first topology."""
    os.environ["JAX_SKIP_CUDA_CONSTRAINTS_CHECK"] = "1"


def prepare_target(name: str) -> None:
    """Check a `--target` before jax starts: a known GPU, and the plugin installed."""
    gpu_of(name)
    check_plugin()
    prepare_host()


@functools.lru_cache(maxsize=None)
def devices(name: str, n_devices: int, hosts: int = 1) -> tuple:
    """`n_devices` compile-only devices of GPU `name` over `hosts` hosts (process index =
    host), in the order `build_mesh` lays out."""
    gpu = gpu_of(name)
    require(hosts >= 1 and n_devices % hosts == 0,
            f"--target {name}: {n_devices} devices do not split evenly over --hosts {hosts}; "
            "give a device count that is a multiple of the host count")
    prepare_target(name)
    from jax.experimental import topologies

    topology = topologies.get_topology_desc(
        platform="cuda", target_config=gpu.target_config(),
        topology=f"{hosts}x1x{n_devices // hosts}")
    return tuple(topology.devices)


def is_compile_only(device) -> bool:
    """A device of a deviceless target (compiles, never runs)."""
    client = getattr(device, "client", None)
    return getattr(client, "runtime_type", "") == "compile_only_runtime"


def overlap_by_default(mesh) -> bool:
    """Whether a step on `mesh` gets, unasked, what hides its weight collectives: the
    prefetching layer loop (`--prefetch auto`, `jdist.parallel.prefetch`) and jdist's XLA
    flags (`GPU_FLAGS`). Only on NVIDIA GPUs, real or compile-only, whose scheduler overlaps
    asynchronous collectives; on the CPU the loop would only cost compile time (it traces a
    layer four times, not twice)."""
    device = mesh.devices.flat[0]
    return is_compile_only(device) or device.platform == "gpu"


def compiler_options(mesh, tp_halves: bool = False, estimator: bool = False) -> dict:
    """Options a step's compile on `mesh` gets: on NVIDIA GPUs the flags jdist sets
    (`gpu_flags`), unless the user set XLA_FLAGS (theirs rule); for a compile-only target
    also what compiling without a device needs; none on the CPU. A plan's step:
    `jdist.step.build.compiler_options`."""
    if not overlap_by_default(mesh):
        return {}
    if is_compile_only(mesh.devices.flat[0]):
        return COMPILER_OPTIONS | gpu_flags(tp_halves, estimator)
    return {} if os.environ.get("XLA_FLAGS") else gpu_flags(tp_halves, estimator)


def capability_of(device) -> tuple[int, ...]:
    """The compute capability of an NVIDIA device: reported by a real one, from the target's
    description for a compile-only one."""
    reported = getattr(device, "compute_capability", None)
    if reported:
        return tuple(int(x) for x in str(reported).split("."))
    return CAPABILITY.get(device.device_kind, ())


def requested(name: str | None, prog: str, default: bool = True) -> str:
    """A benchmark's or report's `--target NAME|none`: '' for none; unset, h100-80gb where
    the CUDA plugin is installed (and `default`). A target that cannot be compiled for
    (unknown, the plugin missing) is one line on stderr and exit status 2."""
    import sys

    if name is None:
        name = "h100-80gb" if default and plugin_installed() else "none"
    if name == "none":
        return ""
    try:
        prepare_target(name)
    except ConfigError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        sys.exit(2)
    return name

"""Mesh strings (`dp=2,fsdp=2,tp=2`), presets from `meshes/*.toml`, and building the `Mesh`.

Every mesh has all six canonical axes (unnamed ones have size 1) in the order of
`jdist.spmd.axes.MESH_AXES`, so sharding rules never need special cases. Axes are
`AxisType.Auto`: jdist places arrays with shardings and lets GSPMD propagate,
and writes collectives by hand only inside `shard_map` kernels.
"""

from __future__ import annotations

import dataclasses
import math
import tomllib
from importlib import resources

from jdist.errors import ConfigError, require
from jdist.spmd.axes import DATA, MESH_AXES, MESH_AXIS_ALIASES, SHORT

FILL = -1  # "whatever is left over" on the command line


@dataclasses.dataclass(frozen=True)
class Link:
    """One kind of link: bandwidth in GB/s (1e9 bytes per second) per device per direction,
    and latency in microseconds per step of a collective (one hop of a ring)."""

    gbps: float
    latency_us: float


# Defaults for a mesh given as AXIS=SIZE pairs (and the values of the cpu-8 preset): a host
# of H100-class GPUs on NVLink (~450 GB/s per direction per GPU), hosts joined by one
# 400 Gb/s NIC per GPU (50 GB/s). Simulated CPU devices have no links worth modelling, and
# GPU numbers make a prediction read as what the same layout would cost where it is meant
# to run. A preset names its own with `ici_gbps`, `ici_latency_us`, `dcn_gbps`, `dcn_latency_us`.
ICI = Link(gbps=450.0, latency_us=2.0)
DCN = Link(gbps=50.0, latency_us=10.0)


@dataclasses.dataclass(frozen=True)
class Links:
    """The links of a topology: ICI within a host, DCN across hosts, and the mesh axes that
    cross hosts. A collective over a group that spans any DCN axis runs at DCN speed."""

    ici: Link = ICI
    dcn: Link = DCN
    dcn_axes: frozenset[str] = frozenset()

    def over(self, axes) -> Link:
        """The link a collective over these mesh axes is bound by: the slowest it crosses."""
        return self.dcn if set(axes) & self.dcn_axes else self.ici


@dataclasses.dataclass(frozen=True)
class MeshSpec:
    """Axis sizes by canonical name (FILL allowed once) plus the part laid across hosts,
    and the links of its topology (a preset's, else the defaults above)."""

    sizes: dict[str, int]
    dcn: dict[str, int] = dataclasses.field(default_factory=dict)
    name: str = ""
    links: Links = Links()

    def resolve(self, n_devices: int) -> dict[str, int]:
        """Concrete sizes for every canonical axis on `n_devices` devices."""
        known = math.prod(s for s in self.sizes.values() if s != FILL)
        sizes = {axis: self.sizes.get(axis, 1) for axis in MESH_AXES}
        fill = [axis for axis, s in sizes.items() if s == FILL]
        if fill:
            require(n_devices % known == 0,
                    f"mesh {self} cannot fill {n_devices} devices: the named axes already "
                    f"use {known}, which does not divide {n_devices}; change the sizes or "
                    "--cpu-devices")
            sizes[fill[0]] = n_devices // known
        require(math.prod(sizes.values()) == n_devices,
                f"mesh {self} needs {math.prod(sizes.values())} devices but {n_devices} are "
                f"available; change the axis sizes or use -1 on one axis to fill")
        return sizes

    def n_devices(self, default_fill: int = 8) -> int:
        """Devices this mesh needs; a FILL axis takes `default_fill` devices in total."""
        if FILL in self.sizes.values():
            return default_fill
        return math.prod(self.sizes.values())

    def __str__(self) -> str:
        body = ",".join(f"{axis}={size}" for axis, size in self.sizes.items()) or "(1 device)"
        return f"{self.name} ({body})" if self.name else body


def parse_axes(text: str) -> dict[str, int]:
    """Parse `dp=2,fsdp=2,tp=2` into {canonical axis: size}."""
    sizes: dict[str, int] = {}
    entries = [e.strip() for e in text.split(",")] if text.strip() else []
    require(all(entries), f"mesh {text!r} has an empty entry (a stray comma); write AXIS=SIZE "
                          "pairs separated by single commas, e.g. --mesh dp=2,tp=2")
    for entry in entries:
        key, eq, value = entry.partition("=")
        require(bool(eq) and bool(key.strip()) and bool(value.strip()),
                f"malformed mesh entry {entry!r}: expected AXIS=SIZE, e.g. --mesh dp=2,tp=4")
        key = key.strip().lower()
        require(key in MESH_AXIS_ALIASES,
                f"unknown mesh axis {key!r} in {text!r}; use one of "
                f"{', '.join(sorted(MESH_AXIS_ALIASES))}")
        axis = MESH_AXIS_ALIASES[key]
        require(axis not in sizes, f"mesh axis {axis!r} is given twice in {text!r}; give it once")
        try:
            size = int(value)
        except ValueError:
            raise ConfigError(f"mesh axis {key!r} has size {value.strip()!r}; sizes are "
                              "positive integers, or -1 to fill the remaining devices") from None
        require(size >= 1 or size == FILL,
                f"mesh axis {key!r} has size {size}; sizes are positive integers, or -1 to fill")
        sizes[axis] = size
    require(list(sizes.values()).count(FILL) <= 1,
            f"mesh {text!r} has more than one -1 axis; at most one axis can fill")
    return {axis: sizes[axis] for axis in MESH_AXES if axis in sizes}


def preset_names() -> list[str]:
    """Names of the mesh presets shipped in `meshes/`."""
    files = resources.files("jdist.meshes").iterdir()
    return sorted(f.name.removesuffix(".toml") for f in files if f.name.endswith(".toml"))


def load_preset(name: str) -> MeshSpec:
    """Load `meshes/NAME.toml`: `mesh = "dp=2,fsdp=8"`, optionally `dcn = "dp=2"` (the
    part across hosts) and the links: `ici_gbps`, `dcn_gbps` (GB/s per device per
    direction), `ici_latency_us`, `dcn_latency_us` (microseconds per collective step)."""
    path = resources.files("jdist.meshes") / f"{name}.toml"
    require(path.is_file(), f"unknown mesh preset {name!r}; use AXIS=SIZE pairs like dp=2,tp=4 "
                            f"or one of: {', '.join(preset_names())}")
    table = tomllib.loads(path.read_text())
    sizes = parse_axes(table["mesh"])
    dcn = parse_axes(table.get("dcn", ""))
    link = lambda kind, default: Link(float(table.get(f"{kind}_gbps", default.gbps)),
                                      float(table.get(f"{kind}_latency_us", default.latency_us)))
    return MeshSpec(sizes, dcn, name, Links(link("ici", ICI), link("dcn", DCN)))


def parse_mesh(text: str) -> MeshSpec:
    """A mesh argument: AXIS=SIZE pairs, or the name of a preset in `meshes/`."""
    text = text.strip()
    if "=" in text or not text:
        return MeshSpec(parse_axes(text))
    return load_preset(text)


def mesh_text(sizes: dict[str, int]) -> str:
    """The `--mesh` argument for these axis sizes (canonical names), in their order, axes of
    size one left out: what `parse_axes` reads back."""
    return ",".join(f"{SHORT[axis]}={n}" for axis, n in sizes.items() if n > 1) or \
        f"{SHORT[DATA]}=1"


def dcn_sizes(sizes: dict[str, int], dcn: dict[str, int], n_granules: int) -> dict[str, int]:
    """How each axis splits across hosts (DCN). Default: the slowest axes, data first."""
    if dcn:
        out = {axis: dcn.get(axis, 1) for axis in MESH_AXES}
    else:
        out, left = {axis: 1 for axis in MESH_AXES}, n_granules
        for axis in MESH_AXES:  # outermost first: cross-host links are the slowest
            take = math.gcd(sizes[axis], left)
            out[axis], left = take, left // take
    require(math.prod(out.values()) == n_granules,
            f"mesh needs {math.prod(out.values())} hosts across DCN but there are {n_granules} "
            f"processes; make the {DATA!r} axis a multiple of the process count")
    for axis in MESH_AXES:
        require(sizes[axis] % out[axis] == 0,
                f"axis {axis!r} of size {sizes[axis]} cannot span {out[axis]} hosts; "
                "make it a multiple of the host count")
    return out


def links_for(text: str, mesh=None) -> Links:
    """The links of a `--mesh` argument (a preset's, else the defaults) and which of its axes
    cross hosts: those its `dcn` declares, or, when `mesh` spans processes, those
    `dcn_sizes` lays across them."""
    spec = parse_mesh(text)
    dcn = spec.dcn
    n_processes = 1 if mesh is None else len({d.process_index for d in mesh.devices.flat})
    if n_processes > 1:
        dcn = dcn_sizes(dict(mesh.shape), spec.dcn, n_processes)
    crossing = frozenset(axis for axis, n in dcn.items() if n > 1)
    return dataclasses.replace(spec.links, dcn_axes=crossing)


def build_mesh(spec: MeshSpec | str, devices=None):
    """Build the `jax.sharding.Mesh` for `spec` over `devices` (default: all devices)."""
    import jax
    from jax.experimental import mesh_utils
    from jax.sharding import AxisType, Mesh

    if isinstance(spec, str):
        spec = parse_mesh(spec)
    devices = list(jax.devices() if devices is None else devices)
    sizes = spec.resolve(len(devices))
    shape = tuple(sizes[axis] for axis in MESH_AXES)
    n_processes = len({d.process_index for d in devices})
    if n_processes > 1:
        dcn = dcn_sizes(sizes, spec.dcn, n_processes)
        ici = tuple(sizes[axis] // dcn[axis] for axis in MESH_AXES)
        grid = mesh_utils.create_hybrid_device_mesh(
            ici, tuple(dcn[axis] for axis in MESH_AXES), devices, process_is_granule=True)
    else:
        try:
            grid = mesh_utils.create_device_mesh(shape, devices, allow_split_physical_axes=True)
        except (ValueError, NotImplementedError, AssertionError):
            import numpy as np  # topologies mesh_utils does not know: plain row-major order

            grid = np.asarray(devices).reshape(shape)
    return Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def describe(mesh) -> str:
    """`data=2 fsdp=2 tensor=2 (8 devices, cpu)`: the non-trivial axes of a mesh."""
    named = " ".join(f"{a}={s}" for a, s in mesh.shape.items() if s > 1) or "single device"
    platform = mesh.devices.flat[0].platform
    return f"{named} ({mesh.devices.size} devices, {platform})"

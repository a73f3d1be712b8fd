"""Accelerator profiles: what one device of a kind can do, as the planner prices a layout.

The published numbers live in `profiles.toml` (package data, one table per accelerator,
every field documented there with its source). `cpu-sim`, the simulated CPU devices of this
machine, is measured instead: `python -m jdist.plan calibrate` writes a calibration file
(`$JDIST_CALIBRATION`, else `~/.cache/jdist/cpu-sim.toml`) whose `[profile]` table and
per-collective ICI fits (`[ici_by_kind.KIND]`) `load_profile("cpu-sim")` reads over the
defaults; `Profile.calibrated` and `Profile.source` say whether it did.
"""

from __future__ import annotations

import dataclasses
import math
import os
import tomllib
from importlib import resources
from pathlib import Path

from jdist.errors import ConfigError, require
from jdist.spmd.mesh import Link, Links
from jdist.tools.comm import RING

CALIBRATED = "cpu-sim"  # the one profile a calibration file applies to
CALIBRATION_ENV = "JDIST_CALIBRATION"


@dataclasses.dataclass(frozen=True)
class Profile:
    """One accelerator, per device (units as in `profiles.toml`'s comments)."""

    name: str
    description: str
    peak_tflops: float
    matmul_efficiency: float
    memory_gb: float
    usable_memory_fraction: float
    memory_gbps: float
    host_gbps: float
    ici_gbps: float
    ici_latency_us: float
    dcn_gbps: float
    dcn_latency_us: float
    devices_per_host: int
    overlap: float
    overlap_tensor: float
    # The devices share the host's cores (simulated CPU devices): an idle pipeline stage's
    # core runs a busy stage's work, so a bubble costs no wall time there.
    shared_cores: bool = False
    # Milliseconds a step costs whatever its size (runtime dispatch and per-operation
    # overhead): calibrated for cpu-sim, negligible against GPU steps (0).
    step_overhead_ms: float = 0.0
    # Collective kinds (jdist.tools.comm.RING's names) measured to run on an ICI link of their own.
    ici_by_kind: tuple[tuple[str, Link], ...] = ()
    calibrated: bool = False
    source: str = ""  # the files the numbers came from
    fp8_rate: float = 1.0  # FP8 matmul throughput over bf16's (`--fp8`)

    @property
    def achievable_flops(self) -> float:
        """FLOP/s one device sustains on large matmuls."""
        return self.peak_tflops * 1e12 * self.matmul_efficiency

    @property
    def memory_bytes(self) -> float:
        return self.memory_gb * 1e9

    @property
    def usable_memory_bytes(self) -> float:
        """What one process may allocate on one device."""
        return self.memory_bytes * self.usable_memory_fraction

    @property
    def ici(self) -> Link:
        return Link(self.ici_gbps, self.ici_latency_us)

    @property
    def dcn(self) -> Link:
        return Link(self.dcn_gbps, self.dcn_latency_us)

    def links(self, dcn_axes=frozenset()) -> Links:
        """The topology's links for `jdist.tools.comm`, with `dcn_axes` the mesh axes
        across hosts."""
        return Links(self.ici, self.dcn, frozenset(dcn_axes))

    def link(self, kind: str, across_hosts: bool = False) -> Link:
        """The link one `kind` collective runs at: DCN across hosts, else its own ICI fit
        when calibration measured one, else the ICI link."""
        if across_hosts:
            return self.dcn
        return dict(self.ici_by_kind).get(kind, self.ici)


FIELDS = {f.name: f.type for f in dataclasses.fields(Profile)}
NUMBERS = [name for name, kind in FIELDS.items() if kind in ("float", "int")]
FRACTIONS = ("matmul_efficiency", "usable_memory_fraction", "overlap", "overlap_tensor")


def profile_names() -> list[str]:
    """Names of the profiles in `profiles.toml`."""
    return sorted(_table())


def calibration_path() -> Path:
    """Where `calibrate` writes and `load_profile("cpu-sim")` reads the calibration."""
    env = os.environ.get(CALIBRATION_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "jdist" / "cpu-sim.toml"


def load_profile(name: str) -> Profile:
    """The profile `name` of `profiles.toml`; for `cpu-sim`, with the calibration file over
    it when one exists."""
    tables = _table()
    require(name in tables, f"unknown accelerator profile {name!r}; use one of "
                            f"{', '.join(sorted(tables))} (or add a table to jdist/plan/"
                            "profiles.toml)")
    entries, source = dict(tables[name]), "jdist/plan/profiles.toml"
    calibrated = False
    if name == CALIBRATED and calibration_path().is_file():
        path = calibration_path()
        entries.update(_calibration_entries(path))
        source, calibrated = f"{path} over {source}", True
    return _profile(name, entries, source, calibrated)


def _table() -> dict:
    text = (resources.files("jdist.plan") / "profiles.toml").read_text()
    return tomllib.loads(text)


def _calibration_entries(path: Path) -> dict:
    """The profile fields a calibration file sets: its `[profile]` table, `ici_by_kind`
    and the device count it measured (one process is one host)."""
    fix = f"rerun `python -m jdist.plan calibrate --out {path}` or delete the file"
    try:
        table = tomllib.loads(path.read_text())
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        raise ConfigError(f"calibration file {path} is unreadable ({e}); {fix}") from None
    require(isinstance(table.get("profile"), dict),
            f"calibration file {path} has no [profile] table; {fix}")
    entries = dict(table["profile"])
    if "ici_by_kind" in table:
        entries["ici_by_kind"] = table["ici_by_kind"]
    if isinstance(table.get("n_devices"), int):
        entries.setdefault("devices_per_host", table["n_devices"])
    unknown = sorted(set(entries) - set(FIELDS))
    require(not unknown, f"calibration file {path} sets unknown profile field(s) "
                         f"{', '.join(unknown)}; {fix}")
    return entries


def _profile(name: str, entries: dict, source: str, calibrated: bool) -> Profile:
    """Validate one profile's entries (every field present, numbers positive and finite,
    fractions in [0, 1]) into a Profile."""
    where = f"profile {name!r} ({source})"
    missing = [f for f in FIELDS if f not in entries
               and f not in ("name", "ici_by_kind", "calibrated", "source", "shared_cores",
                                   "step_overhead_ms", "fp8_rate")]
    require(not missing, f"{where} lacks {', '.join(missing)}; add it to the table")
    unknown = sorted(set(entries) - set(FIELDS) - {"name"})
    require(not unknown, f"{where} has unknown field(s) {', '.join(unknown)}; see the field "
                         "list at the top of jdist/plan/profiles.toml")
    values = {f: entries[f] for f in FIELDS if f in entries}
    for field in (f for f in NUMBERS if f in values):  # optional ones may be absent
        value = values[field]
        require(isinstance(value, int | float) and not isinstance(value, bool)
                and math.isfinite(value), f"{where}: {field} = {value!r} is not a number")
        # A latency of 0 is calibrate's bandwidth-only fit (noise made the fitted one
        # negative): a link model still, not a mistake.
        zero_ok = field in ("overlap", "overlap_tensor", "step_overhead_ms", "ici_latency_us")
        low_ok = value >= 0 if zero_ok else value > 0
        require(low_ok and (field not in FRACTIONS or value <= 1),
                f"{where}: {field} = {value} is out of range "
                f"({'at least 0' if zero_ok else 'positive'}"
                f"{', at most 1' if field in FRACTIONS else ''})")
    values["devices_per_host"] = int(values["devices_per_host"])
    values["ici_by_kind"] = _kind_links(values.get("ici_by_kind", {}), where)
    return Profile(**{**values, "name": name, "calibrated": calibrated, "source": source})


def _kind_links(table: dict, where: str) -> tuple[tuple[str, Link], ...]:
    """`{kind: {gbps, latency_us}}` as sorted (kind, Link) pairs, kinds from
    jdist.tools.comm.RING."""
    out = []
    for kind, entry in sorted(table.items()):
        require(kind in RING, f"{where}: ici_by_kind names {kind!r}, not a collective; use "
                              f"one of {', '.join(RING)}")
        try:
            link = Link(float(entry["gbps"]), float(entry["latency_us"]))
        except (KeyError, TypeError, ValueError):
            raise ConfigError(f"{where}: ici_by_kind.{kind} needs numbers gbps and "
                              "latency_us") from None
        require(link.gbps > 0 and link.latency_us >= 0 and math.isfinite(link.gbps)
                and math.isfinite(link.latency_us),
                f"{where}: ici_by_kind.{kind} = {entry} is out of range")
        out.append((kind, link))
    return tuple(out)

"""Elastic runs: which hosts train, on what layout, and the one line that says why.

The run starts on the hosts available (all, or those `--hosts-file` lists). When a host is
excluded (`jdist.launch.hosts`), the layout is re-planned for the hosts left
(`jdist.launch.replan`) and the group resumes from the newest checkpoint with it; when an
excluded host is listed again and a larger layout fits, the group saves at its next
checkpoint and restarts on it (all hosts back: the original flags).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

from jdist.errors import ConfigError
from jdist.launch.flags import flag_value, with_flag
from jdist.launch.hosts import HostTable
from jdist.launch.replan import Layout, original_layout, replan
from jdist.launch.watch import Watch
from jdist.spmd.mesh import parse_mesh

DEFAULT_MESH = "fsdp=-1"  # the training CLI's default --mesh (jdist.config: a layer above)


def layout_of(train_args: list[str], hosts: int, per_host_gpus: int) -> Layout:
    """The layout the flags ask for on `hosts` hosts: each with `per_host_gpus` GPUs, or on
    the CPU, an even share of the mesh (of --cpu-devices, or 8, for a -1 axis)."""
    spec = parse_mesh(flag_value(train_args, "--mesh") or DEFAULT_MESH)
    cpu = int(flag_value(train_args, "--cpu-devices") or 0) or spec.n_devices(default_fill=8)
    total = per_host_gpus * hosts if per_host_gpus else cpu
    accum = int(flag_value(train_args, "--grad-accum") or 1)
    return original_layout(spec.resolve(total), accum, hosts)


def args_for(train_args: list[str], original: Layout, layout: Layout) -> list[str]:
    """The training flags for `layout`: the user's own for the original layout."""
    if layout == original:
        return train_args
    args = with_flag(with_flag(train_args, "--mesh", layout.mesh()),
                     "--grad-accum", str(layout.grad_accum))
    if flag_value(train_args, "--cpu-devices") is not None:
        args = with_flag(args, "--cpu-devices", str(layout.n_devices()))
    return args


def newest_step(run_dir: str) -> int:
    """The newest step saved under `run_dir` (0: none); the training processes verify it
    and fall back to an older one if it is damaged."""
    root = Path(run_dir) / "checkpoints"
    steps = [int(p.name) for p in root.iterdir() if p.name.isdigit()] if root.is_dir() else []
    return max(steps, default=0)


def describe(before: Layout, after: Layout) -> str:
    change = "kept" if before.sizes == after.sizes else "re-planned"
    return (f"{change} {before.mesh()} (--grad-accum {before.grad_accum}) -> {after.mesh()} "
            f"with --grad-accum {after.grad_accum} on {after.n_devices()} devices "
            f"({after.hosts} host{'s' * (after.hosts > 1)})")


class Elastic:
    """The hosts of one launch and the layout they run."""

    def __init__(self, table: HostTable, original: Layout, per_host: int,
                 exclude_stragglers: bool = False):
        self.table, self.original, self.per_host = table, original, per_host
        self.exclude_stragglers = exclude_stragglers
        self.layout = original
        self.stopping = False  # a new layout is decided; the group stops at a checkpoint
        self._checked = 0.0

    def start(self) -> str | None:
        """Exclude the hosts the file does not list; the line saying so, if any did."""
        self.table.exclude_unlisted()
        if not self.table.excluded:
            return None
        gone = ", ".join(f"host {h} {why}" for h, why in sorted(self.table.excluded.items()))
        return self.shrink(f"{gone}: excluded")

    def args(self, train_args: list[str]) -> list[str]:
        return args_for(train_args, self.original, self.layout)

    def failed(self, hosts: list[int], first: int, watch: Watch,
               say: Callable[[str], None]) -> str | None:
        """After the group on `hosts` failed, process `first` first: the line saying which
        host is excluded (one flagged for silent data corruption, else `first`'s once it
        has failed too often or is gone) and the layout re-planned, or None when all may
        rejoin. When nothing fits any more: says who is excluded, then ConfigError."""
        self.stopping = False
        corrupt = watch.flag("silent data corruption")
        if corrupt is not None:
            host, why = hosts[corrupt], "flagged for silent data corruption"
            self.table.exclude(host, why)
        else:
            host = hosts[first]
            why = self.table.failed(host)
        if not why:
            return None
        try:
            return self.shrink(f"host {host} {why}: excluded")
        except ConfigError:
            say(f"host {host} {why}: excluded")
            raise

    def stop_check(self, hosts: list[int], watch: Watch, say: Callable[[str], None],
                   every_s: float = 1.0) -> Callable[[], bool]:
        """For `Group.wait` of the group on `hosts`: True (stop it) at the first checkpoint
        it saves after a new layout was decided: a larger one (hosts back; the file is read
        every `every_s` seconds), or, with `exclude_stragglers`, one without a straggler."""
        self.stopping, decided_at = False, [0]

        def check() -> bool:
            if self.stopping:
                return watch.saves > decided_at[0]
            line = self.without_straggler(hosts, watch, say)
            if not line and time.monotonic() - self._checked >= every_s:
                self._checked = time.monotonic()
                line = self.grown()
            if line:
                say(line)
                self.stopping, decided_at[0] = True, watch.saves
            return False
        return check

    def without_straggler(self, hosts: list[int], watch: Watch,
                          say: Callable[[str], None]) -> str | None:
        """With `exclude_stragglers`, a straggler reported: exclude it and re-plan (the
        line saying so), or keep it when nothing fits without it (said once). Cheap: it
        reads what `watch` has already seen."""
        slow = watch.flag("straggling") if self.exclude_stragglers else None
        if slow is None:
            return None
        why = f"host {hosts[slow]} flagged as a straggler"
        self.table.exclude(hosts[slow], "flagged as a straggler")
        try:
            return f"{self.shrink(f'{why}: excluded')} at the next checkpoint"
        except ConfigError as e:
            del self.table.excluded[hosts[slow]]
            self.exclude_stragglers = False
            say(f"{why}: kept, since without it {e}")
            return None

    def plan(self) -> Layout:
        """The layout for the hosts usable now (ConfigError when none fits)."""
        return replan(self.original, len(self.table.usable()), self.per_host)

    def hosts(self) -> list[int]:
        """The hosts the current layout runs on, in process order."""
        return self.table.usable()[:self.layout.hosts]

    def shrink(self, why: str) -> str:
        """Re-plan for the hosts left; returns the line that says what and why."""
        before, self.layout = self.layout, self.plan()
        return f"{why}; {describe(before, self.layout)}"

    def grown(self) -> str | None:
        """When excluded hosts are listed again and give a larger layout: the line that says
        so (the caller stops the group at its next checkpoint), else None."""
        back = self.table.returned()
        if not back:
            return None
        bigger = self.plan()
        if bigger.n_devices() <= self.layout.n_devices():
            return None
        hosts = ", ".join(map(str, back))
        before, self.layout = self.layout, bigger
        return f"host {hosts} available again; {describe(before, bigger)} at the next checkpoint"

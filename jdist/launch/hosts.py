"""The launcher's host table: which hosts (here, local processes standing for hosts) are
in the run, how often each failed, and which are excluded and why.

A host is excluded when it has failed `max_failures` times (0: never for that reason), or
when, with an availability file (`--hosts-file`: host ids, one per line or separated by
spaces or commas, `#` comments; an operator, a scheduler's hook or a health check writes
it), it is not listed there within `deadline_s` seconds of failing. An excluded host that
the file lists again is capacity returning.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

from jdist.errors import ConfigError

POLL_S = 0.2


def read_hosts_file(path: Path, n_hosts: int) -> set[int]:
    """The host ids `path` lists; ConfigError for a missing file or an id that is not one of
    the `n_hosts` hosts."""
    try:
        text = path.read_text()
    except OSError as e:
        raise ConfigError(f"--hosts-file {path}: cannot read it ({e.strerror}); write the "
                          f"available host ids 0..{n_hosts - 1} there, one per line") from None
    words = re.sub(r"#.*", "", text).replace(",", " ").split()
    bad = [w for w in words if not w.isdigit() or int(w) >= n_hosts]
    if bad:
        raise ConfigError(f"--hosts-file {path}: {bad[0]!r} is not a host id; list ids "
                          f"0..{n_hosts - 1} (one per --nproc process)")
    return {int(w) for w in words}


class HostTable:
    def __init__(self, n_hosts: int, max_failures: int = 0, deadline_s: float = 60.0,
                 hosts_file: str = ""):
        self.n_hosts, self.max_failures, self.deadline_s = n_hosts, max_failures, deadline_s
        self.file = Path(hosts_file) if hosts_file else None
        self.failures = [0] * n_hosts
        self.excluded: dict[int, str] = {}  # host -> why
        # Excluded hosts seen absent from the file: listed again, they are back. (One that
        # failed too often but was never unlisted has not been seen to; it stays out.)
        self.unlisted: set[int] = set()

    @property
    def elastic(self) -> bool:
        return bool(self.max_failures or self.file)

    def listed(self) -> set[int] | None:
        """The hosts the file lists now (None without a file, or while it cannot be read:
        an editor may be replacing it)."""
        if self.file is None:
            return None
        try:
            return read_hosts_file(self.file, self.n_hosts)
        except ConfigError:
            return None

    def exclude_unlisted(self) -> None:
        """At start: the hosts the file does not list are not in the run."""
        listed = read_hosts_file(self.file, self.n_hosts) if self.file else set(self.usable())
        for host in self.usable():
            if host not in listed:
                self.excluded[host] = f"not listed in {self.file}"
                self.unlisted.add(host)

    def usable(self) -> list[int]:
        return [h for h in range(self.n_hosts) if h not in self.excluded]

    def failed(self, host: int) -> str | None:
        """Count a failure of `host`; wait (up to the deadline) for the file to list it again.
        Returns why it is now excluded, or None when it may rejoin."""
        self.failures[host] += 1
        why = None
        if self.max_failures and self.failures[host] >= self.max_failures:
            times = "once" if self.failures[host] == 1 else f"{self.failures[host]} times"
            why = f"failed {times}"
        elif self.file is not None and not self.back_within(host, self.deadline_s):
            why = f"failed and not back in {self.file} within {self.deadline_s:g} s"
            self.unlisted.add(host)
        if why:
            self.excluded[host] = why
        return why

    def exclude(self, host: int, why: str) -> None:
        """Exclude `host` for what a health check found: back only once the file has
        dropped it and lists it again (it was replaced or repaired)."""
        self.excluded[host] = why

    def back_within(self, host: int, seconds: float) -> bool:
        end = time.monotonic() + seconds
        while True:
            if host in (self.listed() or ()):
                return True
            if time.monotonic() >= end:
                return False
            time.sleep(POLL_S)

    def returned(self) -> list[int]:
        """Excluded hosts the file lists again (failure counts start over for them)."""
        listed = self.listed()
        if listed is None:
            return []
        self.unlisted |= set(self.excluded) - listed
        back = sorted(self.unlisted & listed)
        for host in back:
            del self.excluded[host]
            self.unlisted.discard(host)
            self.failures[host] = 0
        return back

"""`python -m jdist.launch --nproc N [--max-restarts K] -- <train args>`: run N training
processes on this host as one `jax.distributed` group (localhost coordinator), each with its
share of the CPU devices, or on a host with GPUs its own, disjoint share of them: the
visible GPUs (CUDA_VISIBLE_DEVICES, HIP_VISIBLE_DEVICES or ROCR_VISIBLE_DEVICES when set,
else those `nvidia-smi -L` lists) are split evenly, in order, and a count that does not
split over N is refused (exit 2). JAX_PLATFORMS=cpu keeps the CPU. TPU hosts are not split
(one process per TPU host is the usual layout there).

Every output line is prefixed with `[pI]`. When a process fails, the others are killed at
once (a group with a dead member cannot make progress; its collectives would hang) and,
while restarts remain, the group starts again with `--resume auto` from the newest good
checkpoint in the (shared) `--run-dir`. SIGTERM/SIGINT to the launcher are forwarded as
SIGTERM, so every process saves a checkpoint and exits with status 75 (preempted).

Elastic (`--max-host-failures K`, `--hosts-file F`, `--host-deadline S`): each process
stands for a host; a host that fails K times, or is not listed in F again within S seconds
of failing, is excluded and the group resumes on a layout re-planned for the hosts left
(`jdist.launch.elastic`); so is one the replica check outvotes for silent data corruption,
and with `--exclude-stragglers` one the straggler check reports (at the next checkpoint).
An excluded host listed again is taken back at the next checkpoint.

Exit status: 0 when every process finished; 2 for a usage error or when a process reports
one (not retried); 3 for a non-finite loss under --on-nan stop (not retried); 75 when
preempted; otherwise the status of the process that failed first, by exit time (1 when it
died from a signal).
"""

from __future__ import annotations

import os
import queue
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Callable, Mapping

from jdist.errors import (
    EXIT_CONFIG,
    EXIT_CRASH,
    EXIT_NONFINITE,
    EXIT_OK,
    EXIT_PREEMPTED,
    ArgumentParser,
    ConfigError,
    first_paragraph,
    require,
)
from jdist.launch.elastic import Elastic, layout_of, newest_step
from jdist.launch.flags import flag_value, with_flag
from jdist.launch.hosts import HostTable
from jdist.launch.watch import Watch

NOT_RETRIED = (EXIT_CONFIG, EXIT_NONFINITE, EXIT_PREEMPTED)
POLL_S = 0.05


# Variables that choose the GPUs a process sees, the first set one wins. The launcher never
# imports JAX: a parent that initialised a GPU backend would take memory on every GPU.
VISIBILITY_VARS = ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES")


def nvidia_smi_list() -> str | None:
    """`nvidia-smi -L`'s output, or None where there is no working nvidia-smi."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        return subprocess.run([exe, "-L"], capture_output=True, text=True, timeout=30,
                              check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None


def user_environment() -> dict[str, str]:
    """This process's environment as the user gave it: without the JAX_PLATFORMS=cpu that
    importing jdist sets where jax's CUDA plugin has no driver (each child decides again)."""
    import jdist

    env = dict(os.environ)
    if env.pop(jdist.DEFAULTED_MARK, None) and env.get("JAX_PLATFORMS") == "cpu":
        env.pop("JAX_PLATFORMS")
    return env


def visible_devices(environ: Mapping[str, str],
                    list_gpus: Callable[[], str | None] = nvidia_smi_list
                    ) -> tuple[str, list[str]] | None:
    """(the variable that selects them, their ids) for the GPUs this host gives its
    processes, or None when they run on the CPU. A visibility variable already set wins
    (its ids as given: indices or UUIDs, in its order); else the GPUs `nvidia-smi -L` lists
    (by index)."""
    platforms = environ.get("JAX_PLATFORMS", "").lower()
    if platforms and not re.search(r"cuda|gpu|rocm", platforms):
        return None
    for var in VISIBILITY_VARS:
        if var in environ:
            ids = [d.strip() for d in environ[var].split(",") if d.strip()]
            # CUDA reads up to the first invalid id: "-1" (or "") hides every GPU.
            ids = ids[:next((i for i, d in enumerate(ids) if d.startswith("-")), len(ids))]
            return (var, ids) if ids else None
    ids = re.findall(r"^GPU (\d+):", list_gpus() or "", re.MULTILINE)
    return ("CUDA_VISIBLE_DEVICES", ids) if ids else None


def split_devices(ids: list[str], nproc: int) -> list[list[str]]:
    """`nproc` disjoint, equal shares of `ids`, each contiguous (neighbouring GPUs are the
    likeliest to share a switch); ValueError when they do not split evenly."""
    if nproc < 1 or len(ids) % nproc:
        raise ValueError(f"{len(ids)} devices do not split evenly over {nproc} processes")
    per = len(ids) // nproc
    return [ids[i * per:(i + 1) * per] for i in range(nproc)]


def device_env(environ: Mapping[str, str], nproc: int,
               list_gpus: Callable[[], str | None] = nvidia_smi_list) -> list[dict[str, str]]:
    """For each process, the variables that give it its own GPUs ({} each on the CPU).
    ValueError, with what to do, when the GPUs do not split over `nproc`."""
    found = visible_devices(environ, list_gpus)
    if found is None:
        return [{} for _ in range(nproc)]
    var, ids = found
    try:
        shares = split_devices(ids, nproc)
    except ValueError:
        raise ValueError(f"{len(ids)} GPUs ({var}={','.join(ids)}) do not split evenly over "
                         f"--nproc {nproc}; pass an --nproc that divides {len(ids)}, or set "
                         f"{var} to a multiple of {nproc} devices") from None
    return [{var: ",".join(share)} for share in shares]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _say(message: str) -> None:
    print(f"[launch] {message}", flush=True)


def _pump(stream, prefix: str, lock: threading.Lock, seen: Callable[[str], None]) -> None:
    for line in iter(stream.readline, ""):
        with lock:
            sys.stdout.write(f"{prefix} {line}" if line.endswith("\n") else f"{prefix} {line}\n")
            sys.stdout.flush()
        seen(line)


class Group:
    """One attempt: N processes started together and stopped together."""

    def __init__(self, commands: list[list[str]], envs: list[dict[str, str]],
                 on_line: Callable[[str], None] = lambda line: None):
        self.lock = threading.Lock()
        self.procs: list[subprocess.Popen] = []
        self.pumps: list[threading.Thread] = []
        # (exit time, index, status) of each process as it exits: the waiters record the
        # time the moment each one ends, so the first to fail is known even when a survivor
        # fails too before the launcher looks (one poll would see both).
        self.exits: queue.Queue[tuple[float, int, int]] = queue.Queue()
        self.failed = -1  # the index of the process that failed first
        for i, (cmd, env) in enumerate(zip(commands, envs)):
            # Own session: a terminal's Ctrl-C reaches only the launcher, which forwards it.
            p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                 text=True, env=env, start_new_session=True)
            self.procs.append(p)
            t = threading.Thread(target=_pump, args=(p.stdout, f"[p{i}]", self.lock, on_line),
                                 daemon=True)
            t.start()
            self.pumps.append(t)
            threading.Thread(target=self._record_exit, args=(i, p), daemon=True).start()
            _say(f"started process {i} (pid {p.pid})")

    def _record_exit(self, i: int, p: subprocess.Popen) -> None:
        code = p.wait()
        self.exits.put((time.monotonic(), i, code))

    def signal_all(self, sig: int) -> None:
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, sig)
                except ProcessLookupError:
                    pass

    def wait(self, stop: Callable[[], bool] = lambda: False) -> int:
        """Wait until all exit (0) or one fails: then kill the rest and return the status of
        the process that failed first. When `stop()` (asked every poll) says so, the group
        is sent SIGTERM: every process saves and exits 75."""
        exited: list[tuple[float, int, int]] = []
        stopping = False
        while len(exited) < len(self.procs):
            try:  # a timeout keeps the launcher's signal handlers running promptly
                exited.append(self.exits.get(timeout=POLL_S))
            except queue.Empty:
                if not stopping and stop():
                    stopping = True
                    self.signal_all(signal.SIGTERM)
                continue
            failed = sorted(e for e in exited if e[2] != EXIT_OK)
            if failed:
                _, i, code = failed[0]
                self.failed = i
                if code != EXIT_PREEMPTED:
                    _say(f"process {i} exited with status {code}; stopping the group")
                    self.signal_all(signal.SIGKILL)
                else:  # the others are saving the same checkpoint: let them finish
                    for p in self.procs:
                        p.wait()
                self._drain()
                return code
        self._drain()
        return EXIT_OK

    def _drain(self) -> None:
        for p in self.procs:
            p.wait()
        for t in self.pumps:
            t.join(timeout=5)


def start_group(nproc: int, train_args: list[str], devices: list[dict[str, str]],
                on_line: Callable[[str], None] = lambda line: None) -> Group:
    """`nproc` training processes joined by a coordinator on a free local port, each with its
    own devices; `on_line` reads their output."""
    port = free_port()
    commands = [[sys.executable, "-m", "jdist.train", *train_args,
                 "--coordinator", f"127.0.0.1:{port}", "--num-processes", str(nproc),
                 "--process-id", str(i)] for i in range(nproc)]
    envs = [{**user_environment(), "PYTHONUNBUFFERED": "1", **devices[i]} for i in range(nproc)]
    group = Group(commands, envs, on_line)
    for i, share in enumerate(devices):
        if share:
            _say(f"process {i} sees " + " ".join(f"{k}={v}" for k, v in share.items()))
    return group


def make_parser() -> ArgumentParser:
    """The launcher's own flags (the training flags go after `--`)."""
    parser = ArgumentParser(
        prog="python -m jdist.launch", usage="%(prog)s --nproc N [--max-restarts K] -- "
        "<python -m jdist.train flags>", description=first_paragraph(__doc__),
        epilog="Training flags go after --, e.g. python -m jdist.launch --nproc 2 -- --mesh "
               "dp=2,fsdp=4 --steps 100 --run-dir runs/two (one --run-dir, which all "
               "processes share). " + " ".join(__doc__.strip().split("\n\n")[-1].split()))
    parser.add_argument("--nproc", type=int, required=True, help="processes to start")
    parser.add_argument("--max-restarts", type=int, default=0,
                        help="restart the group from its newest checkpoint up to K times")
    parser.add_argument("--max-host-failures", type=int, default=0,
                        help="elastic: exclude a host (process) once it has failed K times and "
                             "re-plan the layout for the hosts left (0: never)")
    parser.add_argument("--hosts-file", default="",
                        help="elastic: a file listing the available host ids 0..N-1; a failed "
                             "host not listed within --host-deadline is excluded, an excluded "
                             "one listed again is taken back at the next checkpoint")
    parser.add_argument("--host-deadline", type=float, default=60.0,
                        help="seconds a failed host has to be listed in --hosts-file again")
    parser.add_argument("--exclude-stragglers", action="store_true",
                        help="elastic: exclude a host the straggler check reports (at the next "
                             "checkpoint); a host a majority of replicas outvotes for silent "
                             "data corruption is always excluded")
    return parser


def elastic_of(args, train_args: list[str], devices: list[dict[str, str]]):
    """The elastic policy the flags ask for (None: a fixed group); ConfigError for flags
    that cannot work."""
    if not (args.max_host_failures or args.hosts_file or args.exclude_stragglers):
        return None
    require(args.max_restarts > 0, "--max-host-failures, --hosts-file and --exclude-stragglers "
            "act when the group restarts; give --max-restarts K too")
    require(args.max_host_failures >= 0 and args.host_deadline >= 0,
            "--max-host-failures and --host-deadline must be >= 0")
    per_host_gpus = len(next(iter(devices[0].values()), "").split(",")) if devices[0] else 0
    original = layout_of(train_args, args.nproc, per_host_gpus)
    total = original.n_devices()
    require(total % args.nproc == 0, f"the mesh's {total} devices do not split over --nproc "
            f"{args.nproc} hosts; use an --nproc that divides {total}")
    table = HostTable(args.nproc, args.max_host_failures, args.host_deadline, args.hosts_file)
    return Elastic(table, original, total // args.nproc, args.exclude_stragglers)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ours, train_args = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) \
        if "--" in argv else (argv, [])
    parser = make_parser()
    try:
        args, unknown = parser.parse_known_args(ours)
    except ConfigError as e:
        print(f"jdist.launch: error: {e}", file=sys.stderr)
        return EXIT_CONFIG
    if unknown:  # most likely training flags given without the `--` that sets them apart
        print(f"jdist.launch: error: unrecognized arguments: {' '.join(unknown)}; training "
              "flags go after --, e.g. python -m jdist.launch --nproc 2 -- "
              f"{' '.join(unknown)}", file=sys.stderr)
        return EXIT_CONFIG
    if args.nproc < 1 or args.max_restarts < 0:
        print("jdist.launch: error: --nproc must be >= 1 and --max-restarts >= 0",
              file=sys.stderr)
        return EXIT_CONFIG
    for flag in ("--coordinator", "--num-processes", "--process-id"):
        if flag_value(train_args, flag) is not None:
            print(f"jdist.launch: error: {flag} is set by the launcher; remove it",
                  file=sys.stderr)
            return EXIT_CONFIG
    try:
        devices = device_env(user_environment(), args.nproc)
    except ValueError as e:
        print(f"jdist.launch: error: {e}", file=sys.stderr)
        return EXIT_CONFIG
    try:  # before anything is started or printed
        elastic = elastic_of(args, train_args, devices)
        start_line = elastic.start() if elastic is not None else None
    except ConfigError as e:
        print(f"jdist.launch: error: {e}", file=sys.stderr)
        return EXIT_CONFIG
    if flag_value(train_args, "--run-dir") is None:  # all processes (and restarts) share it
        train_args += ["--run-dir", time.strftime("runs/%Y%m%d-%H%M%S")]
    _say(f"run dir: {flag_value(train_args, '--run-dir')}")

    group: Group | None = None

    def forward(signum, frame) -> None:
        _say(f"{signal.Signals(signum).name}: asking every process to save and stop")
        if group is not None:
            group.signal_all(signal.SIGTERM)

    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, forward)

    attempt, run_dir = 0, flag_value(train_args, "--run-dir")
    if start_line:
        _say(start_line)
    while True:
        hosts = elastic.hosts() if elastic else list(range(args.nproc))
        watch = Watch()
        group = start_group(len(hosts), elastic.args(train_args) if elastic else train_args,
                            [devices[h] for h in hosts], watch)
        code = group.wait(elastic.stop_check(hosts, watch, _say) if elastic else lambda: False)
        if code == EXIT_OK:
            _say("all processes finished")
            return EXIT_OK
        train_args = with_flag(train_args, "--resume", "auto")
        if code == EXIT_PREEMPTED and elastic and elastic.stopping:
            _say(f"restarting on the new layout from step {newest_step(run_dir)}")
            continue
        if code in NOT_RETRIED or attempt >= args.max_restarts:
            _say(f"exiting with status {code}")
            return code if code > 0 else EXIT_CRASH
        attempt += 1
        if elastic:
            try:
                line = elastic.failed(hosts, group.failed, watch, _say)
            except ConfigError as e:
                print(f"jdist.launch: error: {e}", file=sys.stderr)
                return EXIT_CONFIG
            if line:
                _say(f"{line}; resuming from step {newest_step(run_dir)}")
        _say(f"restart {attempt}/{args.max_restarts} from the newest checkpoint")

if __name__ == "__main__":
    sys.exit(main())

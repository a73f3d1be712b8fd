"""`python -m jdist.launch --nproc N [--max-restarts K] -- <train args>`: run N training
processes on this host as one `jax.distributed` group (localhost coordinator), each with its
share of the CPU devices.

Every output line is prefixed with `[pI]`. When a process fails, the others are killed at
once (a group with a dead member cannot make progress; its collectives would hang) and,
while restarts remain, the group starts again with `--resume auto` from the newest good
checkpoint in the (shared) `--run-dir`. SIGTERM/SIGINT to the launcher are forwarded as
SIGTERM, so every process saves a checkpoint and exits with status 75 (preempted).

Exit status: 0 when every process finished; 2 for a usage error or when a process reports
one (not retried); 3 for a non-finite loss under --on-nan stop (not retried); 75 when
preempted; otherwise the failing process's status (1 when it died from a signal).
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
import time

from jdist.errors import EXIT_CONFIG, EXIT_CRASH, EXIT_NONFINITE, EXIT_OK, EXIT_PREEMPTED

NOT_RETRIED = (EXIT_CONFIG, EXIT_NONFINITE, EXIT_PREEMPTED)
POLL_S = 0.05


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _say(message: str) -> None:
    print(f"[launch] {message}", flush=True)


def _pump(stream, prefix: str, lock: threading.Lock) -> None:
    for line in iter(stream.readline, ""):
        with lock:
            sys.stdout.write(f"{prefix} {line}" if line.endswith("\n") else f"{prefix} {line}\n")
            sys.stdout.flush()


def _flag_value(args: list[str], flag: str) -> str | None:
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            return args[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return None


def _without_flag(args: list[str], flag: str) -> list[str]:
    out, skip = [], False
    for a in args:
        if skip:
            skip = False
        elif a == flag:
            skip = True
        elif not a.startswith(flag + "="):
            out.append(a)
    return out


class Group:
    """One attempt: N processes started together and stopped together."""

    def __init__(self, nproc: int, train_args: list[str]):
        port = free_port()
        self.lock = threading.Lock()
        self.procs: list[subprocess.Popen] = []
        self.pumps: list[threading.Thread] = []
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        for i in range(nproc):
            cmd = [sys.executable, "-m", "jdist.train", *train_args,
                   "--coordinator", f"127.0.0.1:{port}", "--num-processes", str(nproc),
                   "--process-id", str(i)]
            # Own session: a terminal's Ctrl-C reaches only the launcher, which forwards it.
            p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                 text=True, env=env, start_new_session=True)
            self.procs.append(p)
            t = threading.Thread(target=_pump, args=(p.stdout, f"[p{i}]", self.lock), daemon=True)
            t.start()
            self.pumps.append(t)
            _say(f"started process {i} (pid {p.pid})")

    def signal_all(self, sig: int) -> None:
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, sig)
                except ProcessLookupError:
                    pass

    def wait(self) -> int:
        """Wait until all exit (0) or one fails: then kill the rest and return its status."""
        while True:
            codes = [p.poll() for p in self.procs]
            failed = [(i, c) for i, c in enumerate(codes) if c not in (None, EXIT_OK)]
            if failed:
                i, code = failed[0]
                if code != EXIT_PREEMPTED:
                    _say(f"process {i} exited with status {code}; stopping the group")
                    self.signal_all(signal.SIGKILL)
                else:  # the others are saving the same checkpoint: let them finish
                    for p in self.procs:
                        p.wait()
                self._drain()
                return code
            if all(c == EXIT_OK for c in codes):
                self._drain()
                return EXIT_OK
            time.sleep(POLL_S)

    def _drain(self) -> None:
        for p in self.procs:
            p.wait()
        for t in self.pumps:
            t.join(timeout=5)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ours, train_args = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) \
        if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(prog="python -m jdist.launch",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, required=True, help="processes to start")
    parser.add_argument("--max-restarts", type=int, default=0,
                        help="restart the group from its newest checkpoint up to K times")
    args = parser.parse_args(ours)
    if args.nproc < 1 or args.max_restarts < 0:
        print("jdist.launch: error: --nproc must be >= 1 and --max-restarts >= 0",
              file=sys.stderr)
        return EXIT_CONFIG
    for flag in ("--coordinator", "--num-processes", "--process-id"):
        if _flag_value(train_args, flag) is not None:
            print(f"jdist.launch: error: {flag} is set by the launcher; remove it",
                  file=sys.stderr)
            return EXIT_CONFIG
    if _flag_value(train_args, "--run-dir") is None:  # all processes (and restarts) share it
        train_args += ["--run-dir", time.strftime("runs/%Y%m%d-%H%M%S")]
    _say(f"run dir: {_flag_value(train_args, '--run-dir')}")

    group: Group | None = None

    def forward(signum, frame) -> None:
        _say(f"{signal.Signals(signum).name}: asking every process to save and stop")
        if group is not None:
            group.signal_all(signal.SIGTERM)

    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, forward)

    attempt = 0
    while True:
        group = Group(args.nproc, train_args)
        code = group.wait()
        if code == EXIT_OK:
            _say("all processes finished")
            return EXIT_OK
        if code in NOT_RETRIED or attempt >= args.max_restarts:
            _say(f"exiting with status {code}")
            return code if code > 0 else EXIT_CRASH
        attempt += 1
        _say(f"restart {attempt}/{args.max_restarts} from the newest checkpoint")
        train_args = [*_without_flag(train_args, "--resume"), "--resume", "auto"]


if __name__ == "__main__":
    sys.exit(main())

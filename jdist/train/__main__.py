"""`python -m jdist.train`: parse flags, size the simulated CPU platform, join the process
group, train. User mistakes end with one line on stderr and exit status 2; the other exit
statuses are listed in `jdist.errors` (3: non-finite loss, 4: silent data corruption,
5: a checkpoint save failed, 75: preempted)."""

from __future__ import annotations

import sys

from jdist.errors import run_cli
from jdist.runtime.compiler_logs import quiet_compiler


def main(argv: list[str] | None = None) -> int:
    from jdist.runtime.interrupt import exit_at_once_on_ctrl_c

    quiet_compiler()  # before jax starts its backends
    # From the first import of jax until training installs its own handler (finish the
    # step, save, exit 75), Ctrl-C exits 130 at once: nothing is trained yet to save.
    with exit_at_once_on_ctrl_c():
        return _main(argv)


def _main(argv: list[str] | None) -> int:
    from jdist.checkpoint import SaveFailed
    from jdist.train import faults

    def body() -> int:
        try:
            train_from_flags(argv)
        except faults.Preempted as e:
            print(f"jdist: {e}", file=sys.stderr)
            return faults.EXIT_PREEMPTED
        except faults.NonFinite as e:
            print(f"jdist: error: {e}", file=sys.stderr)
            return faults.EXIT_NONFINITE
        except faults.Corruption as e:
            print(f"jdist: error: {e}; stopped without saving (the newest checkpoint predates "
                  "the corruption); check or replace the named devices", file=sys.stderr)
            return faults.EXIT_CORRUPTION
        except SaveFailed as e:
            print(f"jdist: error: {e}", file=sys.stderr)
            return faults.EXIT_SAVE_FAILED
        return 0
    return run_cli(body)


def train_from_flags(argv: list[str] | None) -> None:
    """Parse the flags, size the simulated CPU platform, join the process group, train."""
    from jdist.config import parse_args
    from jdist.runtime.distributed import (
        check_process_split,
        configure_devices,
        initialize,
        process_settings,
    )
    from jdist.spmd.mesh import parse_mesh

    config = parse_args(argv)
    spec = parse_mesh(config.parallel.mesh)
    if config.devices.target:
        from jdist.errors import require
        from jdist.runtime.target import prepare_target

        require(config.memory.dry_run, f"--target {config.devices.target} compiles for GPUs "
                "this machine does not have, which cannot run; add --dry-run")
        prepare_target(config.devices.target)
    coordinator, n_proc, proc_id = process_settings(
        config.devices.coordinator, config.devices.num_processes, config.devices.process_id)
    cpu_devices = config.devices.cpu_devices or spec.n_devices(default_fill=8)
    configure_devices(max(1, cpu_devices // n_proc))
    initialize(coordinator, n_proc, proc_id)
    check_process_split(cpu_devices, n_proc)

    from jdist.train.loop import train

    train(config)


if __name__ == "__main__":
    sys.exit(main())

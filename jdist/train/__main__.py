"""`python -m jdist.train`: parse flags, size the simulated CPU platform, join the process
group, train. User mistakes end with one line on stderr and exit status 2; the other exit
statuses are listed in `jdist.errors` (3: non-finite loss, 4: silent data corruption,
5: a checkpoint save failed, 75: preempted)."""

from __future__ import annotations

import sys

from jdist.errors import require, run_cli


def configure_devices(n_local: int) -> None:
    """Simulate `n_local` CPU devices. Only the CPU platform reads this, so it is harmless
    on accelerators (whose devices are counted as they are, see `check_process_split`); it
    must happen before JAX initialises its backends."""
    import jax

    try:
        jax.config.update("jax_num_cpu_devices", n_local)
    except RuntimeError:  # backends already up (e.g. called from a test): keep what exists
        pass


def check_process_split(cpu_devices: int, n_proc: int) -> None:
    """Every process must hold the same number of devices: on CPU, of the `cpu_devices`
    simulated in all (each process was given its share by `configure_devices`); on
    accelerators, of the devices that exist. Call once the process group is joined."""
    import jax

    n = cpu_devices if jax.default_backend() == "cpu" else jax.device_count()
    require(n % n_proc == 0, f"{n} devices cannot be split evenly over {n_proc} processes; "
            "change the mesh or the process count")


def main(argv: list[str] | None = None) -> int:
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
    from jdist.distributed import initialize, process_settings
    from jdist.mesh import parse_mesh
    from jdist.train.config import parse_args

    config = parse_args(argv)
    spec = parse_mesh(config.parallel.mesh)
    if config.devices.target:
        from jdist.errors import require
        from jdist.target import prepare_target

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

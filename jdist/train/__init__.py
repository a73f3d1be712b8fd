"""The host side of training: flags to a plan (`setup`), the loop (`loop`, `run`), resume,
fault tolerance, health checks and metrics. The compiled step itself is `jdist.step`."""

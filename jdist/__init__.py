"""jdist: one Flax NNX model, any mesh, the same numbers as one device.

Importing this package does not initialise any JAX backend, so the CLI can
still choose how many CPU devices to simulate after `import jdist`.
"""

__version__ = "0.1.0"


# Set (to "1") beside JAX_PLATFORMS=cpu when importing jdist chose it (below): a default
# of ours, not the user's choice, which `jdist.launch` must not pass on as one. An
# environment variable, so that it travels with the one it marks.
DEFAULTED_MARK = "JDIST_DEFAULTED_JAX_PLATFORMS"


def _cpu_without_a_driver() -> None:
    """With jax's CUDA plugin installed (the `cuda12` extra, which also compiles for GPU
    targets) on a machine without an NVIDIA driver, jax prints the plugin's failed
    cuInit traceback at start and then runs on the CPU anyway: say `cpu` up front instead
    (the variable, as jax may not be imported yet: the launcher never imports it). A
    JAX_PLATFORMS the user set is kept; GPU machines are untouched."""
    import os
    import sys

    from jdist.runtime.target import plugin_installed

    if os.environ.get("JAX_PLATFORMS") or os.path.exists("/proc/driver/nvidia/version"):
        return
    if not plugin_installed():
        return
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ[DEFAULTED_MARK] = "1"
    if "jax" in sys.modules:  # jax read the variable already: tell its config
        try:
            sys.modules["jax"].config.update("jax_platforms", "cpu")
        except (RuntimeError, AttributeError):  # backends up already: too late to matter
            pass


_cpu_without_a_driver()

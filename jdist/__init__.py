"""jdist: one Flax NNX model, any mesh, the same numbers as one device.

Importing this package does not initialise any JAX backend, so the CLI can
still choose how many CPU devices to simulate after `import jdist`.
"""

__version__ = "0.1.0"

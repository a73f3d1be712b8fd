"""The machines a run is on: simulated CPU devices, `jax.distributed` process groups, and
deviceless GPU targets (compile-only devices, XLA's GPU flags)."""

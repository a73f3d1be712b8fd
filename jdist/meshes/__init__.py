"""Mesh presets: each `NAME.toml` here is usable as `--mesh NAME`
(see `jdist.spmd.mesh.load_preset`)."""

"""Mesh presets: each `NAME.toml` here is usable as `--mesh NAME` (see `jdist.mesh.load_preset`)."""

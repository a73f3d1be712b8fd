"""Named axes and where arrays live: mesh and logical axis names, meshes, logical-to-mesh
rules, parameter and optimizer shardings, ZeRO layouts, and the manual axes a value varies
over inside a `shard_map`."""

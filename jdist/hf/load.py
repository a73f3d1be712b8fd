"""`--init-from HF_DIR`: a Hugging Face safetensors checkpoint read straight into a plan's
shardings. Every parameter is built with `jax.make_array_from_callback`, so each process
asks only for the blocks its own devices hold, and each block is read as slices of the
file (`safetensors`' lazy `get_slice`, memory-mapped): no device or host ever holds a full
copy of a sharded parameter. A pipeline stage reads only its layers, in the plan's stored
layer order."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np
from safetensors import safe_open

from jdist.errors import require
from jdist.hf import layout
from jdist.hf.config import model_config
from jdist.train.layer_order import BLOCKS, order_of

INDEX, SINGLE = "model.safetensors.index.json", "model.safetensors"


class Source:
    """The tensors of an HF directory (one file or a sharded index), read by slices.
    `bytes_read` counts the bytes requested, per process (what sharded loading saves)."""

    def __init__(self, hf_dir: str | Path):
        self.dir = Path(hf_dir)
        if (self.dir / INDEX).is_file():
            weight_map = json.loads((self.dir / INDEX).read_text())["weight_map"]
        else:
            require((self.dir / SINGLE).is_file(),
                    f"--init-from {hf_dir}: neither {SINGLE} nor {INDEX} is there; save the "
                    "model with safe_serialization (safetensors)")
            with safe_open(self.dir / SINGLE, "numpy") as f:
                weight_map = {k: SINGLE for k in f.keys()}
        self.weight_map = weight_map
        self._files: dict = {}
        self.bytes_read = 0

    def has(self, name: str) -> bool:
        return name in self.weight_map

    def tensor(self, name: str):
        require(self.has(name), f"--init-from {self.dir}: tensor {name!r} is missing from the "
                                "checkpoint; it does not match its config.json")
        file = self.weight_map[name]
        if file not in self._files:
            path = self.dir / file
            require(path.is_file(), f"--init-from {self.dir}: {file} (named in {INDEX}) is "
                                    "missing; re-download the checkpoint")
            self._files[file] = safe_open(path, "numpy")
        return self._files[file].get_slice(name)

    def reader(self, name: str, expect: tuple[int, ...]):
        """`get(slices)` over tensor `name`, float32, after checking its shape."""
        t = self.tensor(name)
        shape = tuple(t.get_shape())
        require(shape == tuple(expect), f"--init-from {self.dir}: tensor {name} has shape "
                                        f"{list(shape)}, but config.json implies {list(expect)}")

        def get(slices):
            block = np.asarray(t[slices])
            self.bytes_read += block.nbytes
            return block.astype(np.float32)
        return get

    def total_bytes(self) -> int:
        total = 0
        for name in self.weight_map:
            t = self.tensor(name)
            itemsize = {"F32": 4, "BF16": 2, "F16": 2, "F64": 8}.get(t.get_dtype(), 4)
            total += itemsize * int(np.prod(t.get_shape()))
        return total


def _leaf(source: Source, path: tuple[str, ...], abstract, sharding, order) -> jax.Array:
    _, kind = layout.TENSORS[path]
    stacked = path[0] == BLOCKS
    shape = abstract.shape[1:] if stacked else abstract.shape
    readers: dict[int | None, object] = {}
    blocks: dict[tuple, np.ndarray] = {}  # devices holding the same block share one read

    def read_layer(layer, index):
        if layer not in readers:
            readers[layer] = source.reader(layout.hf_name(path, layer),
                                           layout.hf_shape(kind, shape))
        return layout.read(readers[layer], kind, shape, index)

    def block(index: tuple[slice, ...]) -> np.ndarray:
        key = tuple(s.indices(n) for s, n in zip(index, abstract.shape))
        if key not in blocks:
            if stacked:
                stored = range(*index[0].indices(abstract.shape[0]))
                blocks[key] = np.stack([read_layer(int(order[p]), index[1:]) for p in stored])
            else:
                blocks[key] = read_layer(None, index)
        return blocks[key]

    return jax.make_array_from_callback(abstract.shape, sharding, block)


def load_params(hf_dir: str | Path, plan, source: Source | None = None) -> dict:
    """The parameters of `hf_dir` as `plan.abstract.params`, laid out as
    `plan.shardings.params` (in the plan's stored layer order), float32."""
    cfg = model_config(hf_dir)
    require(cfg == plan.model, f"--init-from {hf_dir}: its config.json describes a different "
                               "model than this run's; drop the model shape flags")
    source = source or Source(hf_dir)
    order = order_of(plan)

    def one(path, abstract, sharding):
        keys = tuple(k.key for k in path)
        return _leaf(source, keys, abstract, sharding, order)
    return jax.tree_util.tree_map_with_path(one, plan.abstract.params, plan.shardings.params)

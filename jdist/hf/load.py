"""`--init-from HF_DIR`: a Hugging Face safetensors checkpoint read straight into a plan's
shardings. Every parameter is built with `jax.make_array_from_callback`, so each process
asks only for the blocks its own devices hold, and each block is read as slices of the
file (`safetensors`' lazy `get_slice`, memory-mapped): no device or host ever holds a full
copy of a sharded parameter. A pipeline stage reads only its layers, in the plan's stored
layer order."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec
from safetensors import safe_open

from jdist.errors import require
from jdist.hf import layout
from jdist.hf.config import model_config
from jdist.models.names import BLOCKS, is_blocks
from jdist.models.runs import runs
from jdist.parallel.pipeline.layer_order import order_of
from jdist.quant import nf4

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


def tensor_reader(source: Source, table: dict, path: tuple[str, ...], kind: str,
            shape: tuple[int, ...], layer: int | None):
    """`get(slices)` over the HF tensor of `path` (of one layer); for EXPERTS over the
    experts' tensors stacked, each expert's read only where the slices take it."""
    hf_shape = layout.hf_shape(kind, shape)
    if kind != layout.EXPERTS:
        return source.reader(layout.hf_name(table, path, layer), hf_shape)
    per = [source.reader(layout.hf_name(table, path, layer, e), hf_shape)
           for e in range(shape[0])]
    return lambda s: np.stack([per[e](s[1:]) for e in range(*s[0].indices(shape[0]))])


def _leaf(source: Source, table: dict, path: tuple[str, ...], abstract, sharding, order,
          layer: int | None = None) -> jax.Array:
    """One parameter (a stacked one in the stored `order`; or, with `layer`, that layer
    of a stacked one alone) in `abstract`'s dtype, read block by block."""
    _, kind = table[path]
    stacked = is_blocks(path[0]) and layer is None
    shape = abstract.shape[1:] if stacked else abstract.shape
    readers: dict[int | None, object] = {}
    blocks: dict[tuple, np.ndarray] = {}  # devices holding the same block share one read

    def read_layer(layer, index):
        if layer not in readers:
            readers[layer] = tensor_reader(source, table, path, kind, shape, layer)
        return layout.read(readers[layer], kind, shape, index)

    def block(index: tuple[slice, ...]) -> np.ndarray:
        key = tuple(s.indices(n) for s, n in zip(index, abstract.shape))
        if key not in blocks:
            if stacked:
                stored = range(*index[0].indices(abstract.shape[0]))
                blocks[key] = np.stack([read_layer(int(order[p]), index[1:]) for p in stored])
            else:
                blocks[key] = read_layer(layer, index)
        return blocks[key].astype(abstract.dtype)

    return jax.make_array_from_callback(abstract.shape, sharding, block)


def _quantized_leaf(source: Source, table: dict, path: tuple[str, ...], stack: nf4.Nf4,
                    sharding: nf4.Nf4, order, double_quant: bool) -> nf4.Nf4:
    """An NF4-stored stack of weights (QLoRA), quantized on the devices one layer at a time:
    each device reads and holds only its shard of one float32 layer (blocks never straddle
    shards: `check_quantizable` of jdist.step.state), written in place into the stack."""
    codes = stack.codes
    shape = (*codes.shape[1:-1], codes.shape[-1] * 2)
    mesh, spec = sharding.codes.mesh, sharding.codes.spec
    layer_sharding = NamedSharding(mesh, PartitionSpec(*tuple(spec)[1:]))
    per_layer = jax.tree.map(lambda s: NamedSharding(mesh, PartitionSpec(*tuple(s.spec)[1:])),
                             sharding)
    def put(stack, w, i):  # quantize one layer into its slot of the (donated) stack
        q = jax.lax.with_sharding_constraint(nf4.quantize(w, double_quant), per_layer)
        return jax.tree.map(lambda s, x: s.at[i].set(x), stack, q)

    put = jax.jit(put, out_shardings=sharding, donate_argnums=0)
    layer_abstract = jax.ShapeDtypeStruct(shape, np.float32)
    for position, layer in enumerate(order):
        w = _leaf(source, table, path, layer_abstract, layer_sharding, None, layer=int(layer))
        stack = put(stack, w, position)
    return stack


def load_params(hf_dir: str | Path, plan, source: Source | None = None,
                adapters: dict | None = None) -> dict:
    """The parameters of `hf_dir` as `plan.abstract.params`, laid out as
    `plan.shardings.params` (in the plan's stored layer order), in their storage dtypes
    (NF4 where the plan quantizes the base). `adapters`: the LoRA adapters, which a Hugging
    Face model does not have, as the plan stores them (`jdist.step.state.init_adapters`);
    needed when the plan's model has LoRA."""
    require(adapters is not None or plan.model.lora is None,
            "load_params: the plan's model has LoRA adapters, which a Hugging Face model "
            "does not have; pass adapters=jdist.step.state.init_adapters(plan, seed)")
    cfg = model_config(hf_dir)
    require(cfg == dataclasses.replace(plan.model, lora=None),
            f"--init-from {hf_dir}: its config.json describes a different model than this "
            "run's; drop the model shape flags")
    source = source or Source(hf_dir)
    table = layout.tensors(cfg)
    # Each run's stack holds its own layers: their model indices, in stored order.
    order = {run.key: order_of(plan)[run.first:run.first + run.n_layers] for run in runs(cfg)}

    def stored(keys, abstract):
        """The HF layers of a stack's stored rows: a periodic run's j-th blocks are every
        period-th layer (`layout.numbering`), its rows in model order."""
        if not is_blocks(keys[0]):
            return None
        first, every = layout.numbering(cfg, keys)
        return order[keys[0]] if every == 1 else first + every * np.arange(abstract.shape[0])

    adapters = dict(jax.tree_util.tree_leaves_with_path(adapters or {}))
    is_nf4 = lambda x: isinstance(x, nf4.Nf4)
    # Every NF4 stack starts as zeros, all made by one program, then filled layer by layer.
    nf4_only = lambda tree: jax.tree.map(lambda x: x if is_nf4(x) else None, tree,
                                         is_leaf=is_nf4)
    stacks = dict(jax.tree_util.tree_leaves_with_path(jax.jit(
        lambda: jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype),
                             nf4_only(plan.abstract.params)),
        out_shardings=nf4_only(plan.shardings.params))(), is_leaf=is_nf4))

    def one(path, abstract, sharding):
        if path in adapters:
            return adapters[path]
        keys = tuple(k.key for k in path)
        if is_nf4(abstract):  # the plan stores this weight NF4-quantized (QLoRA)
            return _quantized_leaf(source, table, keys, stacks[path], sharding,
                                   order[BLOCKS], plan.double_quant)
        return _leaf(source, table, keys, abstract, sharding, stored(keys, abstract))
    return jax.tree_util.tree_map_with_path(one, plan.abstract.params, plan.shardings.params,
                                            is_leaf=is_nf4)

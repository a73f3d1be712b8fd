"""Hugging Face export: `config.json`, sharded `model-XXXXX-of-YYYYY.safetensors` and
`model.safetensors.index.json`, written leaf by leaf. A parameter stack is read from the
checkpoint on its own (Orbax partial restore), turned into per-layer HF tensors and written
into files of at most `max_shard_bytes`: host memory holds one parameter at a time, never
the model. The directory is staged next to OUT and renamed when complete, so a failed
export leaves nothing behind."""

from __future__ import annotations

import contextlib
import json
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

from jdist.errors import require
from jdist.hf import layout
from jdist.hf.config import CONFIG, hf_config
from jdist.hf.load import INDEX
from models.config import ModelConfig
from models.names import BLOCKS, HEAD

DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}
DEFAULT_SHARD_BYTES = 5 << 30  # as transformers' save_pretrained
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def leaf_paths(cfg: ModelConfig) -> list[tuple[str, ...]]:
    """The parameters of `cfg` in the order they are written."""
    skip = {(HEAD,)} if cfg.tie_embeddings else set()
    return [p for p in layout.TENSORS if p not in skip]


def hf_tensors(path: tuple[str, ...], value: np.ndarray) -> Iterator[tuple[str, np.ndarray]]:
    """(HF name, HF array) of one jdist parameter in model layer order."""
    _, kind = layout.TENSORS[path]
    if path[0] != BLOCKS:
        yield layout.hf_name(path), layout.write(kind, value)
        return
    for i, layer in enumerate(value):
        yield layout.hf_name(path, i), layout.write(kind, layer)


def write_hf(out_dir: str | Path, cfg: ModelConfig, read_leaf: Callable, *,
             dtype: str = "float32", max_shard_bytes: int = DEFAULT_SHARD_BYTES,
             tokenizer_dir: str | Path | None = None) -> dict:
    """Write `cfg`'s parameters, each fetched by `read_leaf(path) -> np.ndarray` (float32,
    model layer order), as an HF directory. Returns the index's weight map."""
    out = Path(out_dir)
    require(not out.exists() or not any(out.iterdir()),
            f"--hf {out}: directory exists and is not empty; choose a new output directory")
    require(dtype in DTYPES, f"--dtype {dtype!r}: use float32 or bfloat16")
    with staged(out) as staging:
        weight_map = _write_tensors(staging, cfg, read_leaf, DTYPES[dtype], max_shard_bytes)
        config = hf_config(cfg, torch_dtype=dtype)
        (staging / CONFIG).write_text(json.dumps(config, indent=2) + "\n")
        for name in TOKENIZER_FILES if tokenizer_dir else ():
            if (Path(tokenizer_dir) / name).is_file():
                shutil.copy2(Path(tokenizer_dir) / name, staging / name)
    return weight_map


@contextlib.contextmanager
def staged(out: Path):
    """A directory filled as OUT.partial and renamed to `out` (absent or empty) only once
    complete; on any failure it is removed and `out` is left as it was."""
    staging = out.with_name(out.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        yield staging
        if out.exists():
            out.rmdir()
        staging.rename(out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _write_tensors(staging: Path, cfg: ModelConfig, read_leaf, dtype,
                   max_shard_bytes: int) -> dict:
    """Fill files up to `max_shard_bytes` in write order; name them once their count is known."""
    files, pending, size, total = [], {}, 0, 0

    def flush():
        nonlocal pending, size
        if pending:
            name = f"part-{len(files):05d}.safetensors"
            save_file(pending, staging / name, metadata={"format": "pt"})
            files.append((name, list(pending)))
            pending, size = {}, 0

    for path in leaf_paths(cfg):
        for name, tensor in hf_tensors(path, read_leaf(path)):
            tensor = np.ascontiguousarray(tensor.astype(dtype))
            if pending and size + tensor.nbytes > max_shard_bytes:
                flush()
            pending[name] = tensor
            size += tensor.nbytes
            total += tensor.nbytes
        del tensor
    flush()
    weight_map = {}
    for i, (temp, names) in enumerate(files):
        final = f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
        (staging / temp).rename(staging / final)
        weight_map.update({n: final for n in names})
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (staging / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    return weight_map

"""Hugging Face export: `config.json`, sharded `model-XXXXX-of-YYYYY.safetensors` and
`model.safetensors.index.json`, written leaf by leaf. A parameter stack is read from the
checkpoint on its own (Orbax partial restore), turned into per-layer HF tensors and written
into files of at most `max_shard_bytes`: host memory holds one parameter at a time, never
the model. The directory is staged next to OUT and renamed when complete, so a failed
export leaves nothing behind."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

from jdist.errors import require
from jdist.hf import layout
from jdist.hf.config import CONFIG, GENERATION_CONFIG, generation_config, hf_config
from jdist.hf.load import INDEX
from jdist.models.config import ModelConfig
from jdist.models.names import is_blocks

DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}
DEFAULT_SHARD_BYTES = 5 << 30  # as transformers' save_pretrained
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja")
BYTES = "bytes"  # jdist's byte-level tokenizer (jdist.data.tokenizer), written as an HF one


def leaf_paths(cfg: ModelConfig) -> list[tuple[str, ...]]:
    """The parameters of `cfg` in the order they are written (an ODD half is written with
    its EVEN one)."""
    return [p for p, (_, kind) in layout.tensors(cfg).items() if kind != layout.ODD]


def hf_tensors(table: dict, path: tuple[str, ...], value: np.ndarray,
               first: int = 0, every: int = 1) -> Iterator[tuple[str, np.ndarray]]:
    """(HF name, HF array) of one jdist parameter in model layer order (`table`:
    `layout.tensors` of the model); a stack of experts gives one tensor per expert. `first`:
    the model index of a stack's first layer (a later run's, `models.runs`); `every`: the
    step between its rows' layers (a periodic run's, `layout.numbering`)."""
    _, kind = table[path]
    if not is_blocks(path[0]):
        yield layout.hf_name(table, path), layout.write(kind, value)
        return
    for row, layer in enumerate(value):
        i = first + row * every
        hf = layout.write(kind, layer)
        if kind == layout.EXPERTS:
            for e, expert in enumerate(hf):
                yield layout.hf_name(table, path, i, e), expert
        else:
            yield layout.hf_name(table, path, i), hf


def write_hf(out_dir: str | Path, cfg: ModelConfig, read_leaf: Callable, *,
             dtype: str = "float32", max_shard_bytes: int = DEFAULT_SHARD_BYTES,
             tokenizer: str | Path | None = None, source: dict | None = None) -> dict:
    """Write `cfg`'s parameters, each fetched by `read_leaf(path) -> np.ndarray` (float32,
    model layer order), as an HF directory. Returns the index's weight map. `tokenizer`:
    none, BYTES, or a tokenizer directory or tokenizer.json whose files are copied.
    `source` (`jdist.hf.config.source_fields`): the config.json fields and the
    generation_config.json of the model this one came from, carried over."""
    out = Path(out_dir)
    require(not out.exists() or not any(out.iterdir()),
            f"--hf {out}: directory exists and is not empty; choose a new output directory")
    require(dtype in DTYPES, f"--dtype {dtype!r}: use float32 or bfloat16")
    source = source or {}
    # First: it refuses what Hugging Face cannot hold, before any tensor is converted.
    config = hf_config(cfg, torch_dtype=dtype, carried=source.get("config"))
    with staged(out) as staging:
        weight_map = _write_tensors(staging, cfg, read_leaf, DTYPES[dtype], max_shard_bytes)
        (staging / CONFIG).write_text(json.dumps(config, indent=2) + "\n")
        generation = source.get("generation_config") or generation_config(config)
        (staging / GENERATION_CONFIG).write_text(json.dumps(generation, indent=2) + "\n")
        if tokenizer is not None:
            write_tokenizer(staging, tokenizer)
    return weight_map


def write_tokenizer(out: Path, tokenizer: str | Path) -> None:
    """The tokenizer's files in `out`: BYTES as an equivalent HF tokenizer, else the files
    of a tokenizer directory (or of the directory of a tokenizer.json)."""
    if str(tokenizer) in ("", BYTES):
        write_byte_tokenizer(out)
        return
    path = Path(tokenizer)
    src = path if path.is_dir() else path.parent
    if not path.is_dir():
        shutil.copy2(path, out / TOKENIZER_FILES[0])
    for name in TOKENIZER_FILES[path.is_file():]:
        if (src / name).is_file():
            shutil.copy2(src / name, out / name)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map, which the ByteLevel pre-tokenizer and
    decoder of `tokenizers` use."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def write_byte_tokenizer(out: Path) -> None:
    """jdist's byte-level tokenizer (id = UTF-8 byte, no special tokens) as a `tokenizers`
    tokenizer.json that transformers loads and that encodes and decodes exactly as it does:
    ByteLevel bytes, one token per byte, no merges. tokenizer_config.json names it, so
    jdist loads it back as the byte tokenizer (which, having no eos, no HF one can be)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {c: b for b, c in _bytes_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(out / TOKENIZER_FILES[0]))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces":
              False, "jdist_tokenizer": BYTES}
    (out / TOKENIZER_FILES[1]).write_text(json.dumps(config, indent=2) + "\n")


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@contextlib.contextmanager
def staged(out: Path):
    """A directory filled as OUT.partial and renamed to `out` (absent or empty) only once
    complete; on any failure it is removed and `out` is left as it was."""
    staging = out.with_name(out.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        yield staging
        # As the user's other files: safetensors creates its files 0600.
        mode = 0o666 & ~_umask()
        for f in staging.iterdir():
            if f.is_file():
                f.chmod(mode)
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

    table = layout.tensors(cfg)
    for path in leaf_paths(cfg):
        value = read_leaf(path)
        if (odd := layout.pair(table, path)) is not None:
            value = layout.interleave_pair(value, read_leaf(odd))
        at = layout.numbering(cfg, path) if is_blocks(path[0]) else (0, 1)
        for name, tensor in hf_tensors(table, path, value, *at):
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

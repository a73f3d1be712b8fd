"""`python -m jdist.export CHECKPOINT --hf OUT_DIR`: a jdist training checkpoint as a Hugging
Face Llama directory that `transformers`' `from_pretrained` loads (`jdist.hf.export`).
CHECKPOINT is a step directory or a run directory (its newest good checkpoint)."""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from jdist.errors import EXIT_CONFIG, ConfigError, require

SIZE = re.compile(r"^(\d+(?:\.\d+)?)\s*([KMG]?B)$", re.IGNORECASE)
UNITS = {"B": 1, "KB": 1 << 10, "MB": 1 << 20, "GB": 1 << 30}


def parse_size(text: str) -> int:
    m = SIZE.match(text.strip())
    require(m is not None, f"--max-shard-size {text!r}: use a size like 5GB, 500MB or 100KB")
    return int(float(m.group(1)) * UNITS[m.group(2).upper()])


def checkpoint_reader(found):
    """`read_leaf(path)` for `write_hf`: one parameter of the checkpoint, on the host, in
    model layer order, and the checkpoint's `ModelConfig`."""
    import jax
    import numpy as np
    from flax import nnx

    from jdist.checkpoint import restore_leaf
    from jdist.train.layer_order import BLOCKS, CHECKPOINT_KEY
    from jdist.train.state import build_model
    from models.config import config_from_dict

    cfg = config_from_dict(found.meta["model"])
    require(not cfg.n_experts, f"{found.path}: a mixture-of-experts checkpoint; Hugging Face "
                               "export supports dense Llama models only")
    abstract = nnx.to_pure_dict(nnx.state(nnx.eval_shape(lambda: build_model(cfg, 0))))
    order = np.asarray(found.meta.get(CHECKPOINT_KEY) or range(cfg.n_layers))
    host = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])

    def read_leaf(path: tuple[str, ...]) -> np.ndarray:
        leaf = abstract
        for k in path:
            leaf = leaf[k]
        value = np.asarray(restore_leaf(found.path, ("params", *path), leaf, host))
        return value[np.argsort(order)] if path[0] == BLOCKS else value
    return cfg, read_leaf


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jdist.export", description=__doc__)
    parser.add_argument("checkpoint", help="checkpoint step directory or run directory")
    parser.add_argument("--hf", required=True, help="output directory (new or empty)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--max-shard-size", default="5GB", help="largest safetensors file")
    parser.add_argument("--tokenizer", default="", help="copy tokenizer files from this dir")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        from jdist.checkpoint import resolve_explicit
        from jdist.hf.export import write_hf

        shard = parse_size(args.max_shard_size)
        require(not args.tokenizer or Path(args.tokenizer).is_dir(),
                f"--tokenizer {args.tokenizer}: not a directory; pass the tokenizer's directory")
        found = resolve_explicit(args.checkpoint, "jdist.export")
        cfg, read_leaf = checkpoint_reader(found)
        weight_map = write_hf(args.hf, cfg, read_leaf, dtype=args.dtype, max_shard_bytes=shard,
                              tokenizer_dir=args.tokenizer or None)
    except ConfigError as e:
        print(f"jdist.export: error: {e}", file=sys.stderr)
        return EXIT_CONFIG
    files = len(set(weight_map.values()))
    print(f"exported step {found.step} of {found.path} to {args.hf}: {len(weight_map)} tensors "
          f"in {files} safetensors file(s), {args.dtype}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""`python -m jdist.export CHECKPOINT --hf OUT_DIR`: a jdist training checkpoint as a Hugging
Face Llama directory that `transformers`' `from_pretrained` loads (`jdist.hf.export`).
CHECKPOINT is a step directory or a run directory (its newest good checkpoint).

A LoRA checkpoint (trained with --lora-rank): `--peft OUT` writes its adapters as a PEFT
LoRA directory (`jdist.hf.peft`; `PeftModel.from_pretrained` loads it on the base model),
and `--hf OUT --merge-lora` a plain Llama with the adapters merged into the base weights.
The base comes from the checkpoint (trained with --save-base), else from the Hugging Face
directory it was trained from (--init-from), else from the seed's initialisation; with
--quantize-base nf4, merged into the NF4 round trip of that base, which is what the adapters
were trained against."""

from __future__ import annotations

import argparse
import functools
import re
import sys
from pathlib import Path

from jdist.errors import EXIT_CONFIG, ConfigError, require, require_writable_dir

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
    from jdist.models.config import config_from_dict
    from jdist.models.names import BLOCKS
    from jdist.parallel.pipeline.layer_order import CHECKPOINT_KEY
    from jdist.step.state import build_model

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


def hf_reader(hf_dir: str | Path, cfg):
    """`read_leaf(path)` over a Hugging Face Llama directory: one parameter of `cfg` (a
    model without adapters) in jdist's layout, float32, model layer order."""
    import numpy as np
    from flax import nnx

    from jdist.hf import layout
    from jdist.hf.load import Source, tensor_reader
    from jdist.models.names import BLOCKS
    from jdist.step.state import build_model

    abstract = nnx.to_pure_dict(nnx.state(nnx.eval_shape(lambda: build_model(cfg, 0))))
    source = Source(hf_dir)
    table = layout.tensors(cfg)

    def read_leaf(path: tuple[str, ...]) -> np.ndarray:
        leaf = abstract
        for k in path:
            leaf = leaf[k]
        _, kind = table[tuple(path)]
        stacked = path[0] == BLOCKS
        shape = tuple(leaf.shape[1:] if stacked else leaf.shape)
        whole = tuple(slice(None) for _ in shape)

        def one(layer):
            get = tensor_reader(source, table, tuple(path), kind, shape, layer)
            return layout.read(get, kind, shape, whole)
        return np.stack([one(i) for i in range(cfg.n_layers)]) if stacked else one(None)
    return read_leaf


def nf4_round_trip(w, double_quant: bool):
    """dequantize(quantize(w)) of a stacked [L, ...] weight, float32 on the host: the base
    weight a --quantize-base nf4 run computes with (`jdist.step.trainable.to_storage`)."""
    import jax
    import numpy as np

    cpu = jax.devices("cpu")[0]
    return np.asarray(_nf4_jit()(jax.device_put(np.asarray(w, np.float32), cpu), double_quant))


@functools.cache
def _nf4_jit():
    import jax

    from jdist.quant import nf4

    return jax.jit(lambda w, dq: nf4.dequantize(nf4.quantize(w, dq, lead=1)),
                   static_argnums=1)


def _quantized(path) -> bool:
    from jdist.step.trainable import NF4, quantized

    return quantized(tuple(path), NF4)


def nf4_reader(read_leaf, double_quant: bool):
    """`read_leaf` whose NF4-quantized weights (the blocks' projections) are their
    `nf4_round_trip`."""
    def read(path: tuple[str, ...]):
        w = read_leaf(path)
        return nf4_round_trip(w, double_quant) if _quantized(path) else w
    return read


def saved_nf4_reader(found, cfg, double_quant: bool, read_checkpoint):
    """`read_leaf` of a --save-base --quantize-base nf4 checkpoint: its quantized weights
    are stored as `jdist.quant.nf4.Nf4` fields (params/.../wq/codes, absmax, [scale, offset]);
    they are read and dequantized (float32, model layer order), the rest as stored."""
    import dataclasses

    import jax
    import numpy as np
    from flax import nnx

    from jdist.checkpoint import restore_leaf
    from jdist.parallel.pipeline.layer_order import CHECKPOINT_KEY
    from jdist.quant import nf4
    from jdist.step.state import build_model

    abstract = nnx.to_pure_dict(nnx.state(nnx.eval_shape(lambda: build_model(cfg, 0))))
    order = np.argsort(np.asarray(found.meta.get(CHECKPOINT_KEY) or range(cfg.n_layers)))
    host = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
    dequantize = jax.jit(nf4.dequantize)

    def read(path: tuple[str, ...]):
        if not _quantized(path):
            return read_checkpoint(path)
        leaf = abstract
        for k in path:
            leaf = leaf[k]
        fields = {}
        for field in dataclasses.fields(nf4.Nf4):
            sds = getattr(nf4.abstract(leaf.shape, double_quant, lead=1), field.name)
            if sds is not None:
                value = restore_leaf(found.path, ("params", *path, field.name), sds, host)
                fields[field.name] = np.asarray(value)[order]  # every field leads with L
        return np.asarray(dequantize(nf4.Nf4(**fields)))
    return read


def seed_reader(cfg, seed: int):
    """`read_leaf` of the parameters `seed` initialises, computed as training initialises
    them (jitted: eager random draws can differ in the last bit)."""
    import jax
    import numpy as np
    from flax import nnx

    from jdist.step.state import build_model

    params = jax.jit(lambda: nnx.to_pure_dict(nnx.state(build_model(cfg, seed))))()
    host = jax.tree.map(np.asarray, params)

    def read_leaf(path: tuple[str, ...]) -> np.ndarray:
        return functools.reduce(lambda tree, k: tree[k], path, host)
    return read_leaf


def lora_base_reader(found, cfg, read_checkpoint):
    """`read_leaf` of the base weights a LoRA checkpoint's adapters were trained on: from
    the checkpoint if it saved them (--save-base), else from its --init-from directory;
    with --quantize-base nf4, as NF4 dequantized them."""
    import dataclasses

    from jdist.hf.config import model_config

    train = found.meta.get("config") or {}
    base_cfg = dataclasses.replace(cfg, lora=None)
    init_from = train.get("init_from") or ""
    quantize = train.get("quantize_base") or "none"
    double_quant = bool(train.get("double_quant"))
    require(quantize in ("none", "nf4"), f"{found.path}: unknown quantize_base {quantize!r}; "
                                         "this jdist.export knows none and nf4")
    if train.get("save_base"):
        if quantize == "nf4":
            return saved_nf4_reader(found, cfg, double_quant, read_checkpoint)
        return read_checkpoint
    if not init_from:  # the base was the seed's initialisation
        read = seed_reader(base_cfg, int((found.meta.get("rng") or {}).get("seed", 0)))
        return nf4_reader(read, double_quant) if quantize == "nf4" else read
    require(Path(init_from).is_dir(),
            f"{found.path}: its base model (--init-from {init_from}) is not there; run the "
            "export where that directory exists, or train with --save-base")
    same = lambda c: dataclasses.replace(c, head_dim=c.dim_per_head)
    require(same(model_config(init_from)) == same(base_cfg),
            f"{found.path}: its base model {init_from} has a different config.json than "
            "the checkpoint's model; restore the directory it was trained from")
    read = hf_reader(init_from, base_cfg)
    return nf4_reader(read, double_quant) if quantize == "nf4" else read


def run_tokenizer(found) -> str:
    """The tokenizer the checkpoint's run trained with (its --tokenizer; bytes by default),
    which must still be there."""
    from jdist.hf.export import BYTES

    spec = (found.meta.get("config") or {}).get("tokenizer") or BYTES
    require(spec == BYTES or Path(spec).exists(),
            f"{found.path} was trained with --tokenizer {spec}, which is not there; pass "
            "--tokenizer DIR (that tokenizer's directory) to write it next to the model")
    return spec


def export_source(found, tokenizer: str) -> dict:
    """What the exported config.json and generation_config.json carry over: the fields the
    checkpoint recorded of its --init-from model (`jdist.hf.config.source_fields`; read from
    the directory for checkpoints older than that record), else the tokenizer's bos and eos
    ids."""
    from jdist.data.tokenizer import load_tokenizer
    from jdist.hf.config import CONFIG, source_fields

    source = found.meta.get("hf_source")
    init_from = (found.meta.get("config") or {}).get("init_from") or ""
    if source is None and init_from and (Path(init_from) / CONFIG).is_file():
        source = source_fields(init_from)
    source = dict(source or {})
    config = dict(source.get("config") or {})
    try:
        tok = load_tokenizer(str(tokenizer))
    except ConfigError:  # e.g. no eos token: it is copied as it is, and names no ids
        return {**source, "config": config}
    for key, value in (("bos_token_id", tok.bos_id), ("eos_token_id", tok.eod_id)):
        if key not in config and value is not None:
            config[key] = value
    return {**source, "config": config}


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m jdist.export", description=__doc__)
    parser.add_argument("checkpoint", help="checkpoint step directory or run directory")
    parser.add_argument("--hf", default="", help="output directory (new or empty) for a "
                        "Hugging Face Llama")
    parser.add_argument("--merge-lora", action="store_true", help="LoRA checkpoint: write "
                        "the base with the adapters merged in to --hf OUT")
    parser.add_argument("--peft", default="", help="LoRA checkpoint: output directory (new "
                        "or empty) for the adapters alone, as PEFT saves them")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                        help="dtype of the written safetensors")
    parser.add_argument("--max-shard-size", default="5GB", help="largest safetensors file")
    parser.add_argument("--tokenizer", default="", help="copy tokenizer files from this dir "
                        "(default: the tokenizer the run trained with; bytes is written as an "
                        "equivalent Hugging Face tokenizer)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = make_parser().parse_args(sys.argv[1:] if argv is None else argv)
    try:
        from jdist.checkpoint import resolve_explicit
        from jdist.hf.export import write_hf

        shard = parse_size(args.max_shard_size)
        require(not args.tokenizer or Path(args.tokenizer).is_dir(),
                f"--tokenizer {args.tokenizer}: not a directory; pass the tokenizer's directory")
        require(args.hf or args.peft, "nothing to write; pass --hf OUT (a Hugging Face "
                                      "model) and/or --peft OUT (LoRA adapters)")
        require(not (args.hf and args.peft and Path(args.hf).resolve() ==
                     Path(args.peft).resolve()),
                f"--hf and --peft are both {args.hf}; give them different directories")
        for flag, out in (("--hf", args.hf), ("--peft", args.peft)):
            if out:  # before the checkpoint is read and hashed
                require_writable_dir(out, f"{flag} {out}")
        found = resolve_explicit(args.checkpoint, "checkpoint")
        cfg, read_leaf = checkpoint_reader(found)
        if cfg.lora is None:
            require(not args.merge_lora, f"--merge-lora: {found.path} has no LoRA adapters; "
                                         "drop --merge-lora to export it as it is")
            require(not args.peft, f"--peft: {found.path} has no LoRA adapters; use --hf OUT")
        else:
            require(not args.hf or args.merge_lora,
                    f"{found.path} is a LoRA checkpoint; pass --merge-lora to write the merged "
                    "model, or --peft OUT for the adapters")
        require(not args.merge_lora or args.hf, "--merge-lora writes the merged model to --hf "
                                                "OUT; add --hf OUT")
        if args.hf and not args.tokenizer:
            run_tokenizer(found)  # checked before anything is written
        for flag, out in (("--hf", args.hf), ("--peft", args.peft)):
            require(not out or not Path(out).exists() or (Path(out).is_dir() and not any(
                Path(out).iterdir())), f"{flag} {out}: exists and is not an empty directory; "
                "choose a new output directory")
        model, read = cfg, read_leaf
        if args.hf and cfg.lora is not None:  # everything checked before anything is written
            import dataclasses

            from jdist.hf.peft import merged_reader
            from jdist.models.lora import is_adapter

            base = lora_base_reader(found, cfg, read_leaf)
            combined = lambda path: read_leaf(path) if is_adapter(path) else base(path)
            model, read = dataclasses.replace(cfg, lora=None), merged_reader(cfg, combined)
        done = []
        if args.peft:
            from jdist.hf.peft import write_peft

            base_model = (found.meta.get("config") or {}).get("init_from") or ""
            names = write_peft(args.peft, cfg, read_leaf, base_model=base_model)
            done.append(f"{len(names)} LoRA tensors (rank {cfg.lora.rank}, float32) to "
                        f"{args.peft}")
        if args.hf:
            tokenizer = args.tokenizer or run_tokenizer(found)
            weight_map = write_hf(args.hf, model, read, dtype=args.dtype,
                                  max_shard_bytes=shard, tokenizer=tokenizer,
                                  source=export_source(found, tokenizer))
            files = len(set(weight_map.values()))
            merged = ", LoRA merged" if cfg.lora is not None else ""
            done.append(f"{len(weight_map)} tensors in {files} safetensors file(s), "
                        f"{args.dtype}{merged}, to {args.hf}")
    except ConfigError as e:
        print(f"jdist.export: error: {e}", file=sys.stderr)
        return EXIT_CONFIG
    print(f"exported step {found.step} of {found.path}: {'; '.join(done)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Command-line flags of `python -m jdist.train`, as one flat dataclass of plain values."""

from __future__ import annotations

import argparse
import dataclasses
import sys

from jdist.errors import ConfigError


@dataclasses.dataclass
class TrainConfig:
    model: str = "small"
    mesh: str = "fsdp=-1"
    steps: int = 300
    batch_size: int = 16  # global, in sequences
    seq_len: int = 128
    lr: float = 3e-3
    warmup: int = 30
    weight_decay: float = 0.1
    clip_norm: float = 1.0
    seed: int = 0
    compute_dtype: str = "float32"
    run_dir: str = ""
    eval_every: int = 100
    eval_batches: int = 4
    log_every: int = 10
    rules: str = ""
    sequence_parallel: bool = False
    data: str = ""
    data_dtype: str = "uint16"
    cpu_devices: int = 0  # 0: as many as the mesh needs (8 for a -1 axis)
    # Model-shape overrides (None: keep the preset's value).
    n_layers: int | None = None
    d_model: int | None = None
    n_heads: int | None = None
    n_kv_heads: int | None = None
    d_ff: int | None = None
    vocab_size: int | None = None
    tie_embeddings: bool | None = None
    # Multi-process (see jdist.distributed); empty: single process or taken from the environment.
    coordinator: str = ""
    num_processes: int = 0
    process_id: int = -1

    def model_overrides(self) -> dict:
        keys = ("n_layers", "d_model", "n_heads", "n_kv_heads", "d_ff", "vocab_size",
                "tie_embeddings")
        return {k: getattr(self, k) for k in keys}


HELP = {
    "model": "model preset: tiny, small, 1b, 7b, 70b",
    "mesh": "mesh as AXIS=SIZE pairs (dp, pp, fsdp, sp/cp, ep, tp; one may be -1) or a preset "
            "name from meshes/",
    "batch_size": "global batch size in sequences (split over data x fsdp)",
    "compute_dtype": "dtype of matmuls and activations; master weights stay float32",
    "run_dir": "where config.json and metrics.jsonl go (default: runs/<time>)",
    "eval_every": "evaluate held-out loss every N steps (0: never)",
    "rules": "TOML file overriding the logical-axis rules ([rules] name = [mesh axes])",
    "sequence_parallel": "shard activations' sequence dim over tensor between TP regions",
    "data": "text file, directory of text files, or .bin of token ids (default: builtin corpus)",
    "data_dtype": "token dtype of a .bin file: uint16 or uint32",
    "cpu_devices": "CPU devices to simulate when the mesh has a -1 axis (default 8)",
}


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2, like every jdist usage error
        raise ConfigError(f"{message}; see --help")


def parse_args(argv: list[str] | None = None) -> TrainConfig:
    parser = _Parser(prog="python -m jdist.train",
                     description="Train a Llama-style model on any device mesh.")
    for field in dataclasses.fields(TrainConfig):
        flag = "--" + field.name.replace("_", "-")
        kind = field.type.split(" |")[0]
        if field.type == "bool":
            parser.add_argument(flag, action="store_true", help=HELP.get(field.name))
        elif field.type == "bool | None":
            parser.add_argument(flag, action="store_true", default=None)
        else:
            parser.add_argument(flag, type={"int": int, "float": float, "str": str}[kind],
                                default=field.default, help=HELP.get(field.name),
                                choices=["float32", "bfloat16"] if field.name == "compute_dtype"
                                else None)
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    return TrainConfig(**vars(args))

"""Command-line flags of `python -m jdist.train`, as one flat dataclass of plain values."""

from __future__ import annotations

import dataclasses
import sys

from jdist.data.sft import FORMATS
from jdist.errors import ArgumentParser
from jdist.loss import LOSSES
from jdist.packing import PACKINGS
from jdist.parallel.attention import IMPLEMENTATIONS
from jdist.parallel.schedule import SCHEDULES


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
    compute_dtype: str = "auto"  # float32; bfloat16 with --quantize-base (QLoRA)
    run_dir: str = ""
    eval_every: int = 100
    eval_batches: int = 4
    log_every: int = 10
    rules: str = ""
    sequence_parallel: bool = False
    cp_strategy: str = "ring"
    attention: str = "auto"
    loss: str = "chunked"
    # Pipeline parallelism over the stage axis (see jdist.parallel.pipeline).
    microbatches: int = 0  # 0: one per stage
    pp_schedule: str = "1f1b"
    pp_virtual_stages: int = 1
    pp_show_schedule: bool = False
    # Memory (see jdist.zero, jdist.remat, jdist.memory).
    zero: int = 0
    grad_accum: int = 1
    remat: str = "none"
    offload: str = "none"
    dry_run: bool = False
    device_memory_gb: float = 0.0  # 0: ask the device (accelerators); CPU has no limit
    peak_tflops: float = 0.0  # 0: the accelerator's dense bf16 peak if known (for MFU)
    data: str = ""
    data_dtype: str = "uint16"
    tokenizer: str = ""
    init_from: str = ""  # a Hugging Face model directory (jdist.hf)
    packing: str = "none"  # jdist.packing.PACKINGS
    data_format: str = "text"  # jdist.data.sft.FORMATS
    cpu_devices: int = 0  # 0: as many as the mesh needs (8 for a -1 axis)
    # Compile for a GPU this machine does not have (jdist.target); with --dry-run.
    target: str = ""
    hosts: int = 1
    # Fine-tuning (see models.lora, jdist.nf4): None rank = full training.
    lora_rank: int | None = None
    lora_alpha: float = 16.0
    lora_targets: str = ""  # "": every projection the model has (attention only for MoE)
    quantize_base: str = "none"
    double_quant: bool = False
    save_base: bool = False
    # Model-shape overrides (None: keep the preset's value).
    n_layers: int | None = None
    d_model: int | None = None
    n_heads: int | None = None
    n_kv_heads: int | None = None
    d_ff: int | None = None
    vocab_size: int | None = None
    tie_embeddings: bool | None = None
    n_experts: int | None = None
    top_k: int | None = None
    moe_routing: str | None = None
    capacity_factor: float | None = None
    aux_loss_weight: float | None = None
    z_loss_weight: float | None = None
    # Multi-process (see jdist.distributed); empty: single process or taken from the environment.
    coordinator: str = ""
    num_processes: int = 0
    process_id: int = -1
    # Checkpoints and fault tolerance (see jdist.checkpoint, jdist.train.faults).
    checkpoint_every: int = 0
    keep: int = 3
    resume: str = "auto"
    on_nan: str = "stop"
    inject_nan_at_step: int = 0
    verify_checkpoint: str = "size"
    # Observability and health checks (see jdist.train.observe, jdist.train.health).
    tensorboard: bool = False
    profile_steps: str = ""
    straggler_every: int = 10
    straggler_threshold: float = 1.5
    straggler_windows: int = 3
    check_replicas_every: int = 100
    recompute_check_every: int = 1000
    inject_corruption_at_step: int = 0
    inject_straggler: str = ""

    def model_overrides(self) -> dict:
        keys = ("n_layers", "d_model", "n_heads", "n_kv_heads", "d_ff", "vocab_size",
                "tie_embeddings", "n_experts", "top_k", "moe_routing", "capacity_factor",
                "aux_loss_weight", "z_loss_weight")
        return {k: getattr(self, k) for k in keys}


HELP = {
    "model": "model preset: tiny, small, moe-tiny, moe-small; shape-only llama2-7b, llama3-8b, "
             "llama3.1-8b, llama3.1-70b, llama3.2-1b, llama3.2-3b, 8x7b "
             "(aliases 1b, 7b, 70b)",
    "mesh": "mesh as AXIS=SIZE pairs (dp, pp, fsdp, sp/cp, ep, tp; one may be -1) or a preset "
            "name from meshes/",
    "batch_size": "global batch size in sequences (split over data x fsdp)",
    "compute_dtype": "dtype of matmuls and activations; master weights stay float32 "
                     "(auto: float32, or bfloat16 with --quantize-base, as QLoRA computes)",
    "run_dir": "where config.json and metrics.jsonl go (default: runs/<time>)",
    "eval_every": "evaluate held-out loss every N steps (0: never)",
    "rules": "TOML file overriding the logical-axis rules ([rules] name = [mesh axes])",
    "sequence_parallel": "shard activations' sequence dim over tensor between TP regions",
    "cp_strategy": "attention when the mesh has sp>1: ring (K/V pass around, load-balanced), "
                   "all_gather (gather K/V), or ulysses (all-to-all to heads)",
    "attention": "attention kernel: auto (cudnn on NVIDIA GPUs in bf16, else flash from "
                 "1024 tokens, else xla), xla (dense reference), flash (pure-JAX blockwise, "
                 "O(S) memory), cudnn",
    "loss": "chunked (cross-entropy over vocab chunks, never [batch, length, vocab] "
            "logits) or full (the reference)",
    "microbatches": "micro-batches per step that stream through the pipeline stages "
                    "(default: one per stage)",
    "pp_schedule": "pipeline schedule: gpipe (all forwards, then all backwards), 1f1b "
                   "(activations of about pp micro-batches alive), interleaved (virtual stages)",
    "pp_virtual_stages": "layer chunks per stage for --pp-schedule interleaved",
    "pp_show_schedule": "print the pipeline schedule (stage x tick grid, bubble) and exit",
    "zero": "ZeRO stage over the data axis: 0 DDP, 1 +optimizer state sharded, "
            "2 +gradients (reduce-scatter), 3 +parameters",
    "grad_accum": "micro-batches per optimizer step (one compiled step, scanned)",
    "remat": "activation checkpointing: none, full, selective, or a policy name "
             "(dots_saveable, offload_selective, ...)",
    "offload": "none, or optimizer: optimizer state lives in pinned host memory between steps",
    "dry_run": "compile the step, print the memory plan and exit",
    "device_memory_gb": "per-device memory budget for the fit check (default: the device's)",
    "peak_tflops": "per-device peak TFLOP/s for the mfu metric (default: the accelerator's "
                   "dense bf16 peak when known; none on CPU)",
    "n_experts": "experts per MoE layer (0: dense MLP); presets moe-tiny, moe-small, 8x7b",
    "top_k": "experts per token (1 or 2 typical)",
    "moe_routing": "dropless (nothing dropped) or capacity (overflow tokens skip the MLP)",
    "capacity_factor": "capacity routing: each expert takes factor x tokens x k / E tokens",
    "aux_loss_weight": "weight of the Switch load-balancing loss",
    "z_loss_weight": "weight of the router z-loss",
    "data": "text file, directory of text files, or .bin of token ids (default: builtin corpus)",
    "data_dtype": "token dtype of a .bin file: uint16 or uint32 (its .bin.json sidecar, "
                  "when there is one, decides)",
    "tokenizer": "Hugging Face tokenizer directory or tokenizer.json (default: bytes)",
    "data_format": "text (documents or token ids) or sft (a .jsonl of prompt/completion or "
                   "chat messages records; loss on the answers only; implies --packing "
                   "documents; needs --tokenizer)",
    "packing": "none (windows of the token stream attend across documents) or documents "
               "(attention and rotary positions restart at each end-of-document id)",
    "init_from": "start from a Hugging Face Llama directory (config.json + safetensors): "
                 "the model shape comes from its config.json, each process reads only its "
                 "shards",
"lora_rank": "train LoRA adapters of this rank; the base model is frozen (no gradients, "
                 "no optimizer state)",
    "lora_alpha": "LoRA scale numerator: adapters add (alpha / rank) x A B",
    "lora_targets": "comma-separated projections to adapt: q,k,v,o,gate,up,down (default: "
                    "all of them; attention only for mixture-of-experts models)",
    "quantize_base": "QLoRA: none, or nf4 (frozen block weights stored as 4-bit NormalFloat "
                     "in blocks of 64, dequantized per layer in the compute dtype)",
    "double_quant": "with --quantize-base nf4: also quantize the block scales to 8 bits "
                    "(blocks of 256): ~0.516 bytes per base weight",
    "save_base": "with LoRA: also save the frozen base weights in checkpoints (by default "
                 "only the adapters and their optimizer state; the base comes back from "
                 "--init-from or the seed)",
    "cpu_devices": "CPU devices to simulate when the mesh has a -1 axis (default 8)",
    "target": "with --dry-run: compile for GPUs this machine does not have (deviceless): "
              "h100-80gb, h200-141gb, a100-80gb; needs the cuda12 extra",
    "hosts": "with --target: hosts the mesh's devices sit on (a -1 axis fills 8 per host)",
    "checkpoint_every": "save an async sharded checkpoint to RUN_DIR/checkpoints every N steps "
                        "(0: only on preemption)",
    "keep": "keep the newest K good checkpoints",
    "resume": "auto (newest good checkpoint in --run-dir, else start fresh), a checkpoint "
              "directory, or none",
    "on_nan": "non-finite loss or gradient: skip the update, rollback to the last checkpoint "
              "and skip that batch, or stop (exit status 3)",
    "inject_nan_at_step": "debug: make step N's loss and gradients NaN (tests --on-nan)",
    "verify_checkpoint": "size (every file of a checkpoint present with its recorded size) or "
                         "full (also re-hash every file) before resuming from it",
    "tensorboard": "also write the metrics as TensorBoard event files under RUN_DIR/tensorboard",
    "profile_steps": "A-B: capture a jax.profiler trace of steps A..B into RUN_DIR/profile and "
                     "record each step's collective/compute/idle fractions of device time",
    "straggler_every": "with several processes: compare the processes' host step times every "
                       "N steps (0: never)",
    "straggler_threshold": "a process whose step time is above this times the median is slow",
    "straggler_windows": "report a process slow for this many consecutive windows",
    "check_replicas_every": "every N steps (and before each save) compare a bitwise "
                            "fingerprint of every parameter and optimizer-state shard across "
                            "the replicas that must be identical (0: never); exit 4 on mismatch",
    "recompute_check_every": "every N steps run the step twice on the same inputs and compare "
                             "the results bitwise (0: never); exit 4 on mismatch",
    "inject_corruption_at_step": "test-only: after step N flip a bit of one replica's copy of a "
                                 "parameter (tests --check-replicas-every)",
    "inject_straggler": "test-only: PROCESS:SECONDS makes that process sleep SECONDS per step "
                        "(tests straggler detection)",
}


CHOICES = {"compute_dtype": ["auto", "float32", "bfloat16"], "attention": list(IMPLEMENTATIONS),
           "loss": list(LOSSES), "packing": list(PACKINGS), "zero": [0, 1, 2, 3],
           "offload": ["none", "optimizer"], "pp_schedule": list(SCHEDULES),
           "data_format": list(FORMATS), "quantize_base": ["none", "nf4"],
           "verify_checkpoint": ["size", "full"]}


def make_parser(prog: str = "python -m jdist.train",
                description: str = "Train a Llama-style model on any device mesh."):
    """One flag per TrainConfig field; usage errors raise ConfigError (one line, exit 2)."""
    parser = ArgumentParser(prog=prog, description=description)
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
                                choices=CHOICES.get(field.name))
    return parser


def parse_args(argv: list[str] | None = None) -> TrainConfig:
    args = make_parser().parse_args(sys.argv[1:] if argv is None else argv)
    return TrainConfig(**vars(args))

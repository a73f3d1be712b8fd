"""The flags of `python -m jdist.train`, one typed group per concern. Each group's
`validate()` holds the checks that need only its own values; checks across groups stay with
the code that combines them (`jdist.train.setup`)."""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

from jdist.config.fields import flag, parse_steps
from jdist.data.packing import PACKINGS
from jdist.data.sft import FORMATS
from jdist.errors import require
from jdist.models.loss import LOSSES
from jdist.parallel.attention import IMPLEMENTATIONS
from jdist.parallel.pipeline.schedule import SCHEDULES

# The choices are the owning modules' own lists, so a new kernel or schedule needs no edit here.
Attention = Literal[IMPLEMENTATIONS]
Loss = Literal[LOSSES]
Packing = Literal[PACKINGS]
Schedule = Literal[SCHEDULES]
DataFormat = Literal[FORMATS]
ON_NAN = ("skip", "rollback", "stop")  # --on-nan policies (jdist.train.faults)
DEFAULT_WARMUP = 30
DEFAULT_PRESET = "small"


@dataclasses.dataclass
class ModelFlags:
    """the model: a preset, its shape overrides, or a Hugging Face checkpoint"""

    preset: str = flag(DEFAULT_PRESET, "model preset (not with --init-from): tiny, small, "
                       "qlora-tiny (head_dim 64: whole NF4 blocks for --quantize-base), "
                       "moe-tiny, moe-small, dense-moe-tiny, deepseek-tiny; shape-only "
                       "llama2-7b, llama3-8b, llama3.1-8b, llama3.1-70b, llama3.2-1b, "
                       "llama3.2-3b, qwen3-0.6b, qwen3-8b, qwen3-32b, mixtral-8x7b, "
                       "qwen3-30b-a3b, qwen3-235b-a22b, deepseek-v3, gemma3-1b, gemma3-27b "
                       "(aliases 1b, 7b, 70b, 8x7b)",
                       name="model")
    init_from: str = flag("", "start from a Hugging Face Llama, Qwen3, Mixtral, Qwen3-MoE, "
                          "DeepSeek-V3 or Gemma 3 (text) directory (config.json + "
                          "safetensors): the model shape comes from its config.json, each "
                          "process reads only its shards", result=True)
    # Shape overrides; None keeps the preset's value.
    n_layers: int | None = flag(None, "transformer blocks (default: the preset's)")
    d_model: int | None = flag(None, "width of the residual stream (default: the preset's)")
    n_heads: int | None = flag(None, "attention (query) heads (default: the preset's)")
    n_kv_heads: int | None = flag(None, "key/value heads, fewer than --n-heads for grouped-"
                                  "query attention (default: the preset's)")
    d_ff: int | None = flag(None, "hidden width of the MLP (default: the preset's)")
    vocab_size: int | None = flag(None, "vocabulary size (default: the preset's)")
    tie_embeddings: bool | None = flag(None, "share the input embedding with the output "
                                       "projection (default: the preset's)")
    qk_norm: bool | None = flag(None, "RMSNorm each query and key head before RoPE, as Qwen3 "
                                "does (default: the preset's)")
    sliding_window: int | None = flag(None, "each query attends to its last N keys only, "
                                      "itself included (gpt-oss, Gemma 3; default: all)")
    attention_sinks: bool | None = flag(None, "a learned logit per head in every attention "
                                        "softmax's denominator, as gpt-oss has")
    full_attention_every: int | None = flag(None, "with --sliding-window: every N-th layer "
                                            "attends to all keys (gpt-oss 2, Gemma 3 6)")
    nope_every: int | None = flag(None, "every N-th layer attends without rotary embeddings "
                                  "(Llama 4, SmolLM3: 4)")
    n_experts: int | None = flag(None, "experts per MoE layer (0: dense MLP); presets "
                                 "moe-tiny, moe-small, mixtral-8x7b, qwen3-30b-a3b")
    top_k: int | None = flag(None, "experts per token (1 or 2 typical)")
    moe_routing: str | None = flag(None, "dropless (nothing dropped; every expert has room "
                                   "for every token), grouped (nothing dropped, at the routed "
                                   "FLOPs) or capacity (overflow tokens skip the MLP)")
    shared_d_ff: int | None = flag(None, "hidden width of a shared expert every token passes "
                                   "through beside the routed ones (0: none)")
    shared_gate: bool | None = flag(None, "scale the shared expert's output by a learned "
                                    "sigmoid gate, as Qwen2-MoE does")
    capacity_factor: float | None = flag(None, "capacity routing: each expert takes factor x "
                                         "tokens x k / E tokens")
    aux_loss_weight: float | None = flag(None, "weight of the Switch load-balancing loss")
    z_loss_weight: float | None = flag(None, "weight of the router z-loss")
    router_bias_rate: float | None = flag(None, "auxiliary-loss-free balancing (DeepSeek-V3): "
                                          "after each step every expert's routing bias "
                                          "moves by this much toward an even load (0: off; "
                                          "0.001 typical)")
    first_dense_layers: int | None = flag(None, "with --n-experts: the first blocks keep a "
                                          "dense MLP (DeepSeek's first_k_dense_replace); "
                                          "a stack of two runs")
    dense_d_ff: int | None = flag(None, "hidden width of those dense blocks' MLP (0: --d-ff)")
    n_expert_groups: int | None = flag(None, "DeepSeek's group-limited routing: experts in "
                                       "this many equal groups (1: no groups)")
    topk_groups: int | None = flag(None, "with --n-expert-groups: each token chooses among "
                                   "the experts of its this-many best groups")
    routed_scale: float | None = flag(None, "the routed experts' weights times this "
                                      "(DeepSeek's routed_scaling_factor; 1: none)")
    kv_lora_rank: int | None = flag(None, "multi-head latent attention: keys and values from "
                                    "a latent this wide (0: plain attention); preset "
                                    "deepseek-tiny")
    mtp_depth: int | None = flag(None, "multi-token prediction (DeepSeek-V3): 1 adds a block "
                                 "predicting the token after next, 0 none")
    mtp_weight: float | None = flag(None, "weight of the multi-token prediction loss in the "
                                    "objective (DeepSeek-V3: 0.3, later 0.1)")

    def overrides(self) -> dict:
        """The shape overrides by field name (None: the preset's value)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.name not in ("preset", "init_from")}

    def validate(self) -> None:
        given = [k for k, v in self.overrides().items() if v is not None]
        require(not (self.init_from and given),
                f"--init-from takes the model shape from {self.init_from}/config.json; drop "
                f"--{given[0].replace('_', '-') if given else ''}")


@dataclasses.dataclass
class FinetuneFlags:
    """fine-tuning: LoRA adapters on a frozen (optionally NF4-quantized, QLoRA) base"""

    lora_rank: int | None = flag(None, "train LoRA adapters of this rank; the base model is "
                                 "frozen (no gradients, no optimizer state) (default: full "
                                 "training)", result=True)
    lora_alpha: float = flag(16.0, "LoRA scale numerator: adapters add (alpha / rank) x A B",
                             result=True)
    lora_targets: str = flag("", "comma-separated projections to adapt: q,k,v,o,gate,up,down "
                             "(default: all of them; attention only for mixture-of-experts "
                             "models)", result=True)
    quantize_base: Literal["none", "nf4"] = flag(
        "none", "QLoRA: none, or nf4 (frozen block weights stored as 4-bit NormalFloat in "
        "blocks of 64, dequantized per layer in the compute dtype)", result=True)
    double_quant: bool = flag(False, "with --quantize-base nf4: also quantize the block "
                              "scales to 8 bits (blocks of 256): ~0.516 bytes per base weight",
                              result=True)
    save_base: bool = flag(False, "with LoRA: also save the frozen base weights in "
                           "checkpoints (by default only the adapters and their optimizer "
                           "state; the base comes back from --init-from or the seed)")

    def validate(self) -> None:
        require(self.lora_rank is not None or self.quantize_base == "none",
                f"--quantize-base {self.quantize_base} quantizes a frozen base, which only "
                "LoRA has; add --lora-rank R")
        require(self.lora_rank is not None or not (self.double_quant or self.save_base),
                f"--{'double-quant' if self.double_quant else 'save-base'} applies to LoRA "
                "fine-tuning; add --lora-rank R or drop the flag")
        require(not self.double_quant or self.quantize_base == "nf4",
                "--double-quant quantizes NF4 block scales; add --quantize-base nf4")


@dataclasses.dataclass
class ParallelFlags:
    """parallelism: the device mesh, how the rules shard over it, and the pipeline"""

    mesh: str = flag("fsdp=-1", "mesh as AXIS=SIZE pairs (dp, pp, fsdp, sp/cp, ep, tp; one "
                     "may be -1) or a preset name from meshes/")
    rules: str = flag("", "TOML file overriding the logical-axis rules ([rules] name = [mesh "
                      "axes]) (default: jdist.spmd.rules.DEFAULT_RULES)")
    sequence_parallel: bool = flag(False, "shard activations' sequence dim over tensor "
                                   "between TP regions (needs tp in --mesh)")
    cp_strategy: str = flag("ring", "attention when the mesh has sp>1: ring (K/V pass around, "
                            "load-balanced), all_gather (gather K/V), or ulysses (all-to-all "
                            "to heads)")
    microbatches: int = flag(0, "micro-batches per step that stream through the pipeline "
                             "stages (default: one per stage)")
    pp_schedule: Schedule = flag("1f1b", "pipeline schedule (needs pp in --mesh): gpipe (all "
                                 "forwards, then all backwards), 1f1b (activations of about "
                                 "pp micro-batches alive), interleaved (virtual stages), zb-h1 "
                                 "(zero bubble: weight gradients fill the drain), zbv (zero "
                                 "bubble, two chunks per stage in a V)")
    pp_virtual_stages: int = flag(1, "layer chunks per stage for --pp-schedule interleaved")
    pp_show_schedule: bool = flag(False, "print the pipeline schedule (stage x tick grid, "
                                  "bubble) and exit")

    def validate(self) -> None:
        pass  # every parallelism check needs the mesh built (jdist.train.setup)


@dataclasses.dataclass
class DeviceFlags:
    """devices and processes: simulated CPUs, a deviceless GPU target, multi-process runs"""

    cpu_devices: int = flag(0, "CPU devices to simulate when the mesh has a -1 axis (default "
                            "8)")
    target: str = flag("", "with --dry-run: compile for GPUs this machine does not have "
                       "(deviceless): h100-80gb, h200-141gb, a100-80gb; needs the cuda12 extra")
    hosts: int = flag(1, "with --target: hosts the mesh's devices sit on (a -1 axis fills 8 "
                      "per host)")
    coordinator: str = flag("", "multi-process runs: HOST:PORT of process 0 (default: "
                            "JDIST_COORDINATOR, or Slurm's, else a single process)")
    num_processes: int = flag(0, "multi-process runs: how many processes (default: "
                              "JDIST_NUM_PROCESSES or Slurm's)")
    process_id: int = flag(-1, "multi-process runs: this process's index (default: "
                           "JDIST_PROCESS_ID or Slurm's)")

    def validate(self) -> None:
        pass  # --hosts is checked where the target's devices are made (setup.mesh_devices)


@dataclasses.dataclass
class MemoryFlags:
    """precision and memory: how each step computes, and what it keeps where"""

    compute_dtype: Literal["auto", "float32", "bfloat16", "float64"] = flag(
        "auto", "dtype of matmuls and activations; master weights stay float32 (auto: "
        "float32, or bfloat16 with --quantize-base, as QLoRA computes; float64, with "
        "JAX_ENABLE_X64=1, verifies FP8 runs across meshes)")
    fp8: Literal["off", "tensorwise", "rowwise"] = flag(
        "off", "the block projections' matmuls (q, k, v, o, gate, up, down) in FP8: e4m3 "
        "operands, e5m2 gradients, float32 accumulation, scales from the current amax per "
        "tensor (tensorwise) or per row (rowwise); off: the compute dtype")
    zero: Literal[0, 1, 2, 3] = flag(0, "ZeRO stage over the data axis: 0 DDP, 1 +optimizer "
                                     "state sharded, 2 +gradients (reduce-scatter), 3 "
                                     "+parameters")
    grad_accum: int = flag(1, "micro-batches per optimizer step (one compiled step, scanned)")
    remat: str = flag("none", "activation checkpointing: none, full, selective, or a policy "
                      "name (dots_saveable, offload_selective, ...)")
    prefetch: Literal["auto", "on", "off"] = flag(
        "auto", "gather layer i+1's parameters while layer i computes (one more layer's "
        "gathered weights): on, off, or auto (on NVIDIA GPUs, where XLA's schedule hides "
        "the gathers behind the layer: benchmarks/overlap.py)")
    tp_halves: bool = flag(False, "run each layer on two halves of the micro-batch's rows, "
                           "so one half's tensor-parallel collectives overlap the other's "
                           "matmuls (dense models; at least 4 rows per device and "
                           "micro-batch)")
    moe_overlap: Literal["auto", "on", "off"] = flag(
        "auto", "under expert parallelism, send each MoE layer's all-to-alls in pieces, so one "
        "piece's transfer runs beside another's expert matmuls: on, off, or auto (on NVIDIA "
        "GPUs: benchmarks/moe.py)")
    expert_matmul: Literal["auto", "loop", "kernel"] = flag(
        "auto", "grouped routing's expert matmuls: loop (XLA matmuls over chunks of "
        "one-expert blocks), kernel (one Pallas kernel per projection over all the blocks: "
        "Triton on NVIDIA GPUs, interpreted elsewhere; not yet timed on a GPU), or auto "
        "(loop)")
    collective_matmul: Literal["auto", "on", "off"] = flag(
        "auto", "under sequence parallelism, bring the residual stream's length chunks to "
        "the tensor-parallel projections (and their partial sums away) by point-to-point "
        "transfers, each beside a chunk's matmul: on, off, or auto (on NVIDIA GPUs: "
        "benchmarks/overlap.py)")
    offload: Literal["none", "optimizer", "params", "disk", "auto"] = flag(
        "none", "what lives in pinned host memory: none; optimizer (its state between "
        "steps); params (parameters, gradients and optimizer state: each layer streamed to "
        "the device in the layer loop, one ahead, its gradient written back, the update "
        "on the host); disk (the optimizer's moments in files under --offload-dir, read, "
        "updated and written back a layer at a time); auto (the smallest of none, "
        "optimizer and params the memory model says fits)")
    offload_dir: str = flag("", "--offload disk: where the moments' files live (default: "
                            "RUN_DIR/optimizer_state; a local NVMe disk)")
    attention: Attention = flag("auto", "attention kernel: auto (cudnn on NVIDIA GPUs in bf16, "
                                "else flash from 1024 tokens, else xla), xla (dense "
                                "reference), flash (pure-JAX blockwise, O(S) memory), cudnn")
    loss: Loss = flag("chunked", "chunked (cross-entropy over vocab chunks, never [batch, "
                      "length, vocab] logits) or full (the reference)")
    dry_run: bool = flag(False, "compile the step, print the memory plan and exit")
    device_memory_gb: float = flag(0.0, "per-device memory budget for the fit check (default: "
                                   "the device's; CPU has no limit)")

    def validate(self) -> None:
        """Also checked by `make_plan`, which tests and benchmarks call without flags."""
        from jdist.models import remat as remat_policies
        from jdist.spmd.zero import STAGES

        require(self.zero in STAGES, f"--zero {self.zero} is not a ZeRO stage; use 0, 1, 2 "
                "or 3")
        require(self.grad_accum >= 1, f"--grad-accum {self.grad_accum} must be at least 1")
        remat_policies.check(self.remat)
        for name in ("prefetch", "collective_matmul", "moe_overlap"):  # auto/on/off switches
            value = getattr(self, name)
            require(value in ("auto", "on", "off"),
                    f"unknown --{name.replace('_', '-')} {value!r}; use auto, on or off")
        require(self.attention in IMPLEMENTATIONS,
                f"unknown --attention {self.attention!r}; use {', '.join(IMPLEMENTATIONS)}")
        require(self.loss in LOSSES, f"unknown --loss {self.loss!r}; use {', '.join(LOSSES)}")
        import jax  # config parses without jax; only this check reads it

        require(self.compute_dtype != "float64" or jax.config.jax_enable_x64,
                "--compute-dtype float64 needs 64-bit JAX: set JAX_ENABLE_X64=1")
        require(self.fp8 in ("off", "tensorwise", "rowwise"),
                f"unknown --fp8 {self.fp8!r}; use off, tensorwise or rowwise")
        require(self.expert_matmul in ("auto", "loop", "kernel"),
                f"unknown --expert-matmul {self.expert_matmul!r}; use auto, loop or kernel")
        require(self.expert_matmul != "kernel" or self.fp8 == "off",
                "--expert-matmul kernel runs the experts in the compute dtype, not FP8; use "
                "--fp8 off or --expert-matmul loop")
        require(self.fp8 == "off" or not self.tp_halves,
                "--fp8 scales over all of a micro-batch's tokens, --tp-halves splits them; "
                "drop one")
        require(self.fp8 == "off" or self.collective_matmul != "on",
                "--collective-matmul on runs its own matmuls, not FP8 ones; use "
                "--collective-matmul off with --fp8")


@dataclasses.dataclass
class OptimFlags:
    """the optimizer: AdamW or Muon, linear warmup, then cosine or warmup-stable-decay to a
    tenth, global-norm clipping"""

    steps: int = flag(300, "optimizer steps (the learning-rate schedule spans them)",
                      result=True)
    lr: float = flag(3e-3, "peak learning rate (0: the weights stay as they start, e.g. to "
                     "check a round trip)", result=True)
    warmup: int = flag(DEFAULT_WARMUP, "steps of linear learning-rate warmup, from lr/N at step "
                       f"1 to lr at step N (0 or 1: none); below --steps (default: "
                       f"{DEFAULT_WARMUP}, cut to --steps - 1 in shorter runs)", result=True)
    weight_decay: float = flag(0.1, "AdamW's decoupled weight decay", result=True)
    clip_norm: float = flag(1.0, "clip the gradients to this global norm", result=True)
    optimizer: Literal["adamw", "muon"] = flag(
        "adamw", "adamw, or muon: Newton-Schulz orthogonalised Nesterov momentum for the "
        "blocks' projection matrices (each layer's and expert's separately), AdamW for the "
        "embedding, head, norms, router and LoRA adapters", result=True)
    schedule: Literal["cosine", "wsd"] = flag(
        "cosine", "after the warmup: cosine decay to a tenth, or wsd: constant, then a "
        "1-sqrt decay over the last --decay-fraction of the steps, to a tenth at the last "
        "step", result=True)
    decay_fraction: float = flag(0.2, "with --schedule wsd, the fraction of --steps spent "
                                 "decaying", result=True)

    def validate(self) -> None:
        require(self.steps >= 1, f"--steps {self.steps} must be at least 1")
        require(math.isfinite(self.lr) and self.lr >= 0,
                f"--lr {self.lr} must be 0 (no update) or positive (the peak learning rate, "
                "e.g. 3e-4)")
        require(self.warmup >= 0, f"--warmup {self.warmup} must be 0 (none) or positive")
        # The default is cut to fit a short run; a warmup asked for must fit as given (0 and
        # 1 are none: step 1 at lr).
        require(self.warmup < self.steps or self.warmup <= 1 or self.warmup == DEFAULT_WARMUP,
                f"--warmup {self.warmup} is not below --steps {self.steps}: no step would be "
                f"left for the decay; pass --warmup below {self.steps} (0: none)")
        require(math.isfinite(self.weight_decay) and self.weight_decay >= 0,
                f"--weight-decay {self.weight_decay} must be 0 (none) or positive")
        require(math.isfinite(self.clip_norm) and self.clip_norm > 0,
                f"--clip-norm {self.clip_norm} must be positive (0 would zero every update)")
        require(0 < self.decay_fraction <= 1,
                f"--decay-fraction {self.decay_fraction} must be above 0 and at most 1 (the "
                "fraction of --steps the wsd schedule decays over, e.g. 0.2)")


@dataclasses.dataclass
class DataFlags:
    """the data: what is read, how it is tokenized and packed, and the batch"""

    path: str = flag("", "text file, directory of text files, .bin of token ids, or Hugging "
                     "Face .parquet/.arrow files (a file or a dataset directory); several "
                     "weighted as PATH:WEIGHT,PATH:WEIGHT (default: builtin corpus)",
                     result=True, name="data")
    data_dtype: str = flag("uint16", "token dtype of a .bin file: uint16 or uint32 (its "
                           ".bin.json sidecar, when there is one, decides)", result=True)
    tokenizer: str = flag("", "Hugging Face tokenizer directory or tokenizer.json (default: "
                          "the --init-from directory's own, else bytes)", result=True)
    data_format: DataFormat = flag("text", "text (documents or token ids) or sft (a .jsonl of "
                                   "prompt/completion or chat messages records; loss on the "
                                   "answers only; implies --packing documents; needs "
                                   "--tokenizer)", result=True)
    text_column: str = flag("text", "the column of .parquet/.arrow files that holds the text",
                            result=True)
    allow_truncation: bool = flag(False, "with --data-format sft, train even when more than 5%% "
                                  "of the records are longer than --seq-len (they are cut, "
                                  "losing their answers' ends); by default that is refused")
    packing: Packing = flag("none", "none (windows of the token stream attend across "
                            "documents) or documents (attention and rotary positions restart "
                            "at each end-of-document id)", result=True)
    batch_size: int = flag(16, "global batch size in sequences (split over data x fsdp)",
                           result=True)
    seq_len: int = flag(128, "tokens per sequence", result=True)
    seed: int = flag(0, "seed of the parameter initialisation and the data order",
                     result=True)

    def validate(self) -> None:
        require(self.batch_size >= 1, f"--batch-size {self.batch_size} must be at least 1")
        require(self.seq_len >= 2, f"--seq-len {self.seq_len} must be at least 2")
        require(bool(self.text_column), "--text-column is empty; name the column of the "
                ".parquet/.arrow files that holds the text (default: text)")
        # Read as text, records would train on their JSON syntax, quotes and keys included.
        require(not (self.path.endswith(".jsonl") and self.data_format == "text"),
                f"--data {self.path} is JSON lines, which --data-format text would train on "
                "as raw JSON text; pass --data-format sft for prompt/completion or chat "
                "records, or for {\"text\": ...} records run python -m jdist.data tokenize "
                f"{self.path} --out FILE.bin and pass --data FILE.bin")


@dataclasses.dataclass
class CheckpointFlags:
    """the run directory, checkpoints and fault tolerance"""

    run_dir: str = flag("", "where config.json and metrics.jsonl go (default: runs/<time>)")
    checkpoint_every: int = flag(0, "also save an async sharded checkpoint to "
                                 "RUN_DIR/checkpoints every N steps (0: only the final one "
                                 "and on preemption)")
    no_final_checkpoint: bool = flag(False, "do not save a checkpoint at the end of the run "
                                     "(by default every run ends with one)")
    keep: int = flag(3, "keep the newest K good checkpoints")
    resume: str = flag("auto", "auto (newest good checkpoint in --run-dir, else start fresh), "
                       "a checkpoint directory, or none")
    verify_checkpoint: Literal["size", "full"] = flag(
        "full", "full (every file of a checkpoint re-hashed against its manifest: finds a "
        "flipped byte) or size (only each file's size: no re-read) before resuming from it")
    on_nan: str = flag("stop", "non-finite loss or gradient: skip the update, rollback to the "
                       "last checkpoint and skip that batch, or stop (exit status 3)")
    inject_nan_at_step: int = flag(0, "debug: make step N's loss and gradients NaN (tests "
                                   "--on-nan)")

    def validate(self) -> None:
        require(self.on_nan in ON_NAN,
                f"--on-nan {self.on_nan!r} is not a policy; use one of {', '.join(ON_NAN)}")
        require(self.checkpoint_every >= 0,
                f"--checkpoint-every {self.checkpoint_every} must be 0 (only at the end) or "
                "positive")
        require(self.keep >= 1, f"--keep {self.keep} must be at least 1")
        _require_off_or_positive(self, "inject_nan_at_step")


@dataclasses.dataclass
class ObserveFlags:
    """observability: logging, evaluation, metrics, profiles and health checks"""

    log_every: int = flag(10, "print a progress line every N steps")
    eval_every: int = flag(100, "evaluate held-out loss every N steps (0: never)")
    eval_batches: int = flag(4, "held-out batches per evaluation (from the last 5 percent of "
                             "the data)")
    tensorboard: bool = flag(False, "also write the metrics as TensorBoard event files under "
                             "RUN_DIR/tensorboard")
    peak_tflops: float = flag(0.0, "per-device peak TFLOP/s for the mfu metric (default: the "
                              "accelerator's dense bf16 peak when known; none on CPU)")
    profile_steps: str = flag("", "A-B: capture a jax.profiler trace of steps A..B into "
                              "RUN_DIR/profile and record each step's collective/compute/idle "
                              "fractions of device time")
    straggler_every: int = flag(10, "with several processes: compare the processes' host step "
                                "times every N steps (0: never)")
    straggler_threshold: float = flag(1.5, "a process whose step time is above this times the "
                                      "median is slow")
    straggler_windows: int = flag(3, "report a process slow for this many consecutive windows")
    check_replicas_every: int = flag(100, "every N steps (and before each save) compare a "
                                     "bitwise fingerprint of every parameter and optimizer-"
                                     "state shard across the replicas that must be identical "
                                     "(0: never); exit 4 on mismatch")
    recompute_check_every: int = flag(1000, "every N steps run the step twice on the same "
                                      "inputs and compare the results bitwise (0: never); "
                                      "exit 4 on mismatch")
    inject_corruption_at_step: int = flag(0, "test-only: after step N flip a bit of one "
                                          "replica's copy of a parameter (tests "
                                          "--check-replicas-every)")
    inject_straggler: str = flag("", "test-only: PROCESS:SECONDS[:FROM_STEP] makes that "
                                 "process sleep SECONDS per step (from step FROM_STEP) (tests "
                                 "straggler and slowdown detection)")

    def validate(self) -> None:
        require(self.eval_batches >= 1 or not self.eval_every,
                f"--eval-batches {self.eval_batches} must be at least 1 (or pass "
                "--eval-every 0)")
        for name in ("inject_corruption_at_step", "check_replicas_every",
                     "recompute_check_every", "straggler_every"):
            _require_off_or_positive(self, name)
        if self.profile_steps:
            parse_steps(self.profile_steps)
        require(self.straggler_windows >= 1,
                f"--straggler-windows {self.straggler_windows} must be at least 1")
        require(self.straggler_threshold > 1,
                f"--straggler-threshold {self.straggler_threshold} must be above 1 (a ratio "
                "to the median step time)")


def compute_dtype_name(memory: MemoryFlags, finetune: FinetuneFlags) -> str:
    """`--compute-dtype`, with `auto` resolved: float32, but bfloat16 for QLoRA (whose base
    is dequantized in the compute dtype, as the QLoRA paper computes)."""
    if memory.compute_dtype != "auto":
        return memory.compute_dtype
    return "float32" if finetune.quantize_base == "none" else "bfloat16"


def _require_off_or_positive(group, name: str) -> None:
    value = getattr(group, name)
    require(value >= 0, f"--{name.replace('_', '-')} {value} must be 0 (off) or positive")

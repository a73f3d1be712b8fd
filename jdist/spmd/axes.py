"""Every axis name in jdist, spelled once.

Mesh axes are physical (groups of devices); logical axes say what a tensor
dimension means. Model code imports only the logical names; `jdist.spmd.rules`
maps logical names onto mesh axes.
"""

# Mesh axes, outermost (slowest links) to innermost (fastest links).
DATA = "data"
STAGE = "stage"
FSDP = "fsdp"
SEQUENCE = "sequence"
EXPERT = "expert"
TENSOR = "tensor"
MESH_AXES = (DATA, STAGE, FSDP, SEQUENCE, EXPERT, TENSOR)
# The axes over which whole replicas of the step split the batch and ZeRO shards the state:
# the gradient shard_map is manual over these (jdist.step.grads), the rest is GSPMD's.
REPLICA_AXES = (DATA, FSDP)

# Command-line spellings of each mesh axis.
MESH_AXIS_ALIASES = {
    "dp": DATA, "data": DATA,
    "pp": STAGE, "stage": STAGE,
    "fsdp": FSDP,
    "sp": SEQUENCE, "cp": SEQUENCE, "sequence": SEQUENCE,
    "ep": EXPERT, "expert": EXPERT,
    "tp": TENSOR, "tensor": TENSOR,
}
# dp, pp, fsdp, sp, ep, tp: the short command-line spelling of each axis, for messages.
SHORT = {axis: min((k for k, v in MESH_AXIS_ALIASES.items() if v == axis), key=len)
         for axis in MESH_AXES}

# Logical axes of activations.
BATCH = "batch"
LENGTH = "length"          # sequence positions (queries, residual stream, logits)
KV_LENGTH = "kv_length"    # key/value positions inside attention
ACT_EMBED = "act_embed"    # model dimension of an activation

# Logical axes of parameters (heads, kv_heads, mlp, vocab also name activation dims).
EMBED = "embed"
HEADS = "heads"
KV_HEADS = "kv_heads"
HEAD_DIM = "head_dim"
MLP = "mlp"
VOCAB = "vocab"
NORM = "norm"              # scale vectors of normalisation layers
LAYERS = "layers"          # the stacked-layer dimension of the transformer blocks
EXPERTS = "experts"
LORA_RANK = "lora_rank"    # the low-rank dimension of LoRA adapters: never sharded
NF4_BLOCKS = "nf4_blocks"  # second-level (double quantization) scales of an NF4 weight

# Every logical name a rule may name (a rules file naming another is a typo, refused).
LOGICAL_AXES = (BATCH, LENGTH, KV_LENGTH, ACT_EMBED, EMBED, HEADS, KV_HEADS, HEAD_DIM, MLP,
                VOCAB, NORM, LAYERS, EXPERTS, LORA_RANK, NF4_BLOCKS)

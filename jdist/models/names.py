"""The top-level names of a model's parameter tree, as `models.Llama` defines its
attributes: the one spelling that the step, checkpoints, exports and tools import."""

EMBED = "embed"            # the token embedding table [vocab, embed]
BLOCKS = "blocks"          # the stacked decoder layers, leading `layers` dimension
FINAL_NORM = "final_norm"  # the RMSNorm scale after the last block
HEAD = "head"              # the untied output head [embed, vocab]; absent when tied
MTP = "mtp"                # the multi-token prediction module (models.mtp); absent without


def run_key(i: int) -> str:
    """Run i's stack (`models.runs`): the first run is `BLOCKS`, so a model of one run
    keeps today's names; later runs are `blocks_1`, `blocks_2`, ..."""
    return BLOCKS if i == 0 else f"{BLOCKS}_{i}"


def in_block(keys: tuple[str, ...]) -> tuple[str, ...]:
    """A block parameter's path inside its block (`attn`, `wq`): without the run's key,
    nor a periodic run's position (`layer_j`, `models.llama.Period`)."""
    keys = keys[1:]
    return keys[1:] if keys and keys[0].startswith("layer_") else keys


def is_blocks(key) -> bool:
    """Whether a top-level key (a str, or a jax path entry) names a stack of blocks."""
    key = getattr(key, "key", key)
    return isinstance(key, str) and (key == BLOCKS or key.startswith(BLOCKS + "_"))

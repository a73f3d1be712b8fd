"""The top-level names of a model's parameter tree, as `models.Llama` defines its
attributes: the one spelling that the step, checkpoints, exports and tools import."""

EMBED = "embed"            # the token embedding table [vocab, embed]
BLOCKS = "blocks"          # the stacked decoder layers, leading `layers` dimension
FINAL_NORM = "final_norm"  # the RMSNorm scale after the last block
HEAD = "head"              # the untied output head [embed, vocab]; absent when tied

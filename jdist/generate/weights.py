"""Where generation's weights come from: a jdist training checkpoint (its parameters only,
restored straight into the inference plan's shardings) or a Hugging Face checkpoint
(`jdist.hf`). The model's shape comes with them: a checkpoint's metadata records it."""

from __future__ import annotations

import sys
import time

import jax.numpy as jnp
import numpy as np
import optax

from jdist import checkpoint as ckpt
from jdist.config.groups import MemoryFlags
from jdist.errors import ConfigError, require
from jdist.rules import DEFAULT_RULES, Rules
from jdist.step.layer_order import CHECKPOINT_KEY, permute
from jdist.step.state import Plan, make_plan
from models import ModelConfig
from models.config import config_from_dict

DEFAULT_CONTEXT = 2048  # tokens of prompt plus completion, unless the model says otherwise


def inference_plan(cfg: ModelConfig, mesh, rules: Rules = DEFAULT_RULES,
                   dtype=jnp.float32) -> Plan:
    """The parameters' layout on `mesh`, as training lays them out (no optimizer state)."""
    memory = MemoryFlags(compute_dtype=jnp.dtype(dtype).name)
    return make_plan(cfg, mesh, rules, optax.identity(), memory)


def find_checkpoint(text: str) -> ckpt.Found:
    """`--checkpoint`: a step directory, or a run or checkpoints directory (its newest step),
    which must be intact."""
    return ckpt.resolve_explicit(text, "--checkpoint")


def checkpoint_model(found: ckpt.Found) -> ModelConfig:
    """The model shape a checkpoint was trained with (recorded in its metadata)."""
    require(bool(found.meta.get("model")), f"--checkpoint {found.path}: its metadata records "
            "no model shape; pass a checkpoint written by python -m jdist.train")
    try:
        cfg = config_from_dict(found.meta["model"])
    except TypeError as e:
        raise ConfigError(f"--checkpoint {found.path}: its model metadata does not match this "
                          f"jdist version ({e}); generate with the version that wrote it") from None
    cfg.validate()
    return cfg


def restore_params(found: ckpt.Found, plan: Plan) -> dict:
    """The checkpoint's parameters (not its optimizer state) in `plan`'s shardings and in
    model layer order; each device reads only its shards."""
    import orbax.checkpoint as ocp

    require(found.meta.get("base_saved", True),
            f"--checkpoint {found.path} holds LoRA adapters without their base model; merge "
            f"them first (python -m jdist.export {found.path} --hf OUT --merge-lora) and "
            "generate with --init-from OUT")
    start = time.perf_counter()
    target = {"params": ckpt.abstract_target(plan.abstract.params, plan.shardings.params)}
    args = ocp.args.PyTreeRestore(
        item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target),
        partial_restore=True)
    with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as checkpointer:
        out = checkpointer.restore(found.path.absolute(),
                                   args=ocp.args.Composite(**{ckpt.STATE: args}))
    params = out[ckpt.STATE]["params"]
    saved_order = found.meta.get(CHECKPOINT_KEY)
    if saved_order is not None:  # an interleaved pipeline stores the stack permuted
        params = permute(params, np.argsort(saved_order))
    print(f"restored parameters of step {found.step} from {found.path} in "
          f"{time.perf_counter() - start:.2f}s", file=sys.stderr)
    return params


def hf_context(hf_dir: str) -> int:
    """The longest sequence a Hugging Face model was made for (max_position_embeddings)."""
    from jdist.hf.config import read_config

    return int(read_config(hf_dir).get("max_position_embeddings") or DEFAULT_CONTEXT)

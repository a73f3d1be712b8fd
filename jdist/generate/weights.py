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
from jdist.models import ModelConfig
from jdist.models.config import config_from_dict
from jdist.parallel.pipeline.layer_order import CHECKPOINT_KEY, permute
from jdist.spmd.rules import DEFAULT_RULES, Rules
from jdist.step.state import Plan, init_adapters, make_plan

DEFAULT_CONTEXT = 2048  # tokens of prompt plus completion, unless the model says otherwise


def inference_plan(cfg: ModelConfig, mesh, rules: Rules = DEFAULT_RULES,
                   dtype=jnp.float32) -> Plan:
    """The parameters' layout on `mesh`, as training lays them out (no optimizer state)."""
    memory = MemoryFlags(compute_dtype=jnp.dtype(dtype).name)
    return make_plan(cfg, mesh, rules, optax.identity(), memory)


def find_checkpoint(text: str) -> ckpt.Found:
    """`--checkpoint`: a step directory, or a run or checkpoints directory (its newest step),
    which must be intact: every file re-hashed (Orbax would restore a flipped byte as it is)."""
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

    from jdist.step import trainable

    adapters_only = not found.meta.get("base_saved", True)
    start = time.perf_counter()
    base = lora_base(found, plan) if adapters_only else None
    abstract, shardings = (trainable.checkpointed(plan.model, t, save_base=not adapters_only)
                           for t in (plan.abstract.params, plan.shardings.params))
    target = {"params": ckpt.abstract_target(abstract, shardings)}
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
    if base is not None:
        params = trainable.with_base(params, base)
    print(f"restored parameters of step {found.step} from {found.path} in "
          f"{time.perf_counter() - start:.2f}s", file=sys.stderr)
    return params


def lora_base(found: ckpt.Found, plan: Plan) -> dict:
    """The frozen base a checkpoint of LoRA adapters alone was trained on, as training
    builds it: its --init-from directory's weights, else the seed's initialisation (with
    the adapters at their initial values, which the checkpoint's replace)."""
    from pathlib import Path

    from jdist.step.state import init_state

    train = found.meta.get("config") or {}
    fix = (f"merge them first (python -m jdist.export {found.path} --hf OUT --merge-lora) and "
           "generate with --init-from OUT")
    require((train.get("quantize_base") or "none") == "none",
            f"--checkpoint {found.path} holds LoRA adapters trained on an NF4 base; {fix}")
    seed = int((found.meta.get("rng") or {}).get("seed", 0))
    init_from = train.get("init_from") or ""
    if not init_from:
        return init_state(plan, seed).params
    require(Path(init_from).is_dir(), f"--checkpoint {found.path} holds LoRA adapters whose "
            f"base model (--init-from {init_from}) is not there; run where it is, or {fix}")
    from jdist.hf.load import load_params

    return load_params(init_from, plan, adapters=init_adapters(plan, seed))


def hf_context(hf_dir: str) -> int:
    """The longest sequence a Hugging Face model was made for (max_position_embeddings)."""
    from jdist.hf.config import read_config

    return int(read_config(hf_dir).get("max_position_embeddings") or DEFAULT_CONTEXT)

"""What a run resumes from (`--resume auto|PATH|none`), whether that checkpoint belongs to
this run's computation, the state it starts with, and the metadata every checkpoint carries."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
from jax.tree_util import keystr

from jdist import checkpoint as ckpt
from jdist.config import result_flags
from jdist.errors import require
from jdist.parallel.pipeline.layer_order import CHECKPOINT_KEY, restore_order
from jdist.step import moment_files, trainable
from jdist.step.disk_update import init_on_disk
from jdist.step.state import Plan, TrainState, init_adapters, init_state, state_from_params

# Flags that decide *what* is computed (their fields' "result" metadata). A resumed run must
# keep them; everything else (mesh, ZeRO stage, process count, remat, ...) only decides *how*
# and may change.
RESULT_FLAGS = result_flags()
# Result flags a resumed run may still change: --steps extends (or shortens) the run, and with
# it the learning-rate schedule's total, as MaxText and torchtitan runs are extended (said in
# one line, `schedule_change`).
EXTENDABLE = ("steps",)


# Checkpoint metadata: whether the parameters saved include the frozen base (LoRA saves
# only the adapters unless --save-base; full training always saves everything).
BASE_SAVED = "base_saved"


def saved_state(plan: Plan, state: TrainState, save_base: bool) -> TrainState:
    """What a checkpoint holds of `state`: `state` itself, or with LoRA (unless
    `save_base`) the adapters and their optimizer state."""
    params = trainable.checkpointed(plan.model, state.params, save_base)
    return state if params is state.params else state._replace(params=params)


def run_meta(config, model, mesh, step: int, data_fingerprint: str = "",
             layer_order=None, hf_source: dict | None = None) -> dict:
    """Saved with every checkpoint. Batches are a pure function of (seed, step), so the data
    position is the step and the only RNG state is the seed. `layer_order` is how the
    stacked blocks are stored (`jdist.parallel.pipeline.layer_order`). `hf_source`: what an
    export keeps of the --init-from model (`jdist.hf.config.source_fields`), so it needs not the
    directory."""
    order = list(range(model.n_layers)) if layer_order is None else \
        [int(i) for i in layer_order]
    return {CHECKPOINT_KEY: order, "step": step, "data_position": step,
            "rng": {"seed": config.data.seed},
            "config": config.flat(), "model": dataclasses.asdict(model),
            "mesh": dict(mesh.shape), "processes": jax.process_count(),
            "jax": jax.__version__, "data_fingerprint": data_fingerprint,
            **({"hf_source": hf_source} if hf_source is not None else {})}


def _plain(x):
    return json.loads(json.dumps(x))


def check_compatible(found: ckpt.Found, config, model, data_fingerprint: str = "") -> None:
    saved_model, saved = found.meta.get("model", {}), found.meta.get("config", {})
    # A model field newer than the checkpoint (say qk_norm) had its default when it was written.
    model_defaults = _plain({f.name: f.default for f in dataclasses.fields(model)
                             if f.default is not dataclasses.MISSING})
    for key, value in _plain(dataclasses.asdict(model)).items():
        was = saved_model.get(key, model_defaults.get(key))
        require(was == value,
                f"--resume: checkpoint {found.path} is of a model with {key}={was}"
                f" but this run's model has {key}={value}; pass the same --model and shape flags "
                "to resume it, or choose a new --run-dir")
    current = _plain(config.flat())
    # A flag newer than the checkpoint was at its default when the checkpoint was written.
    defaults = _plain(type(config)().flat())
    saved = {key: saved.get(key, defaults[key]) for key in RESULT_FLAGS}
    for key in (k for k in RESULT_FLAGS if k not in EXTENDABLE):
        flag = "--" + key.replace("_", "-")
        require(saved[key] == current[key],
                f"--resume: checkpoint {found.path} was written with {flag} {saved[key]} but "
                f"this run has {flag} {current[key]}; pass the same value (a resumed run may "
                "change only the mesh, ZeRO stage, process count and other layout flags), or "
                "choose a new --run-dir")
    # Last: the flags above name what differs; a fingerprint only says that something did.
    saved_data = found.meta.get("data_fingerprint", "")
    require(not (saved_data and data_fingerprint and saved_data != data_fingerprint),
            f"--resume: checkpoint {found.path} was trained on different data (fingerprint "
            f"{saved_data}, now {data_fingerprint}: the --data contents or this Python's stdlib "
            "changed); resume with the same data or start a new --run-dir")


def micro_batches(config, mesh_shape: dict) -> int:
    """Micro-batches per optimizer step: accumulated (--grad-accum) or pipelined
    (--microbatches, default one per stage)."""
    stages = mesh_shape.get("stage", 1)
    return config["grad_accum"] * ((config["microbatches"] or stages) if stages > 1 else 1)


def check_numerics(found: ckpt.Found, config, model, mesh_shape: dict) -> None:
    """Layout flags that change more than rounding: the compute dtype (auto resolved), and
    for mixture-of-experts models the micro-batching (routing capacity and the balancing
    loss are computed per micro-batch). A dense model's micro-batching changes only the
    order of a sum, so it may change on resume."""
    from jdist.step.from_flags import compute_dtype_of

    defaults = _plain(type(config)().flat())
    saved = {**defaults, **found.meta.get("config", {})}
    was = compute_dtype_of(config.replace(compute_dtype=saved["compute_dtype"],
                                          quantize_base=saved["quantize_base"]))
    now = compute_dtype_of(config)
    require(was == now, f"--resume: checkpoint {found.path} was trained in {was.__name__} "
            f"but this run computes in {now.__name__}; pass --compute-dtype "
            f"{was.__name__} (or start a new --run-dir)")
    if model.n_experts:
        was, now = (micro_batches(c, m) for c, m in
                    ((saved, found.meta.get("mesh", {})), (config.flat(), mesh_shape)))
        require(was == now, f"--resume: checkpoint {found.path} was trained with {was} "
                f"micro-batches per step but this run uses {now}, which changes a "
                "mixture-of-experts model's routing; keep --grad-accum x --microbatches "
                f"at {was}")


def find(config, model, run_dir: Path, data_fingerprint: str = "",
         mesh_shape: dict | None = None) -> ckpt.Found | None:
    """The checkpoint to start from, or None for a fresh start. Raises ConfigError for an
    unusable explicit PATH or a mismatched checkpoint; with `auto`, passes over (and moves
    aside) unusable checkpoints, saying so. Runs on every process."""
    root = ckpt.checkpoint_root(run_dir)
    if config.checkpoint.resume == "none":
        existing = ckpt.step_dirs(root)
        require(not existing,
                f"--resume none, but {root} already holds checkpoints (up to step "
                f"{existing[-1][0] if existing else 0}); pass --resume auto to continue that run "
                "or choose a new --run-dir")
        return None
    if config.checkpoint.resume == "auto":
        found = ckpt.latest_good(root, full=config.checkpoint.verify_checkpoint == "full")
        if found is None:
            return None
        for path, why in found.skipped:
            ckpt._say(f"{path} is not usable ({why}); falling back to an earlier checkpoint")
        if found.step < 0:
            ckpt._say(f"no usable checkpoint in {root}; starting from scratch")
    else:
        found = ckpt.resolve_explicit(config.checkpoint.resume,
                                      full=config.checkpoint.verify_checkpoint == "full")
        newer = [s for s, p in ckpt.step_dirs(root) if s > found.step]
        require(not newer,
                f"--resume {config.checkpoint.resume}: this run's {root} already holds later "
                "checkpoints "
                f"(up to step {newer[-1] if newer else 0}) that new saves would collide with; "
                "choose a new --run-dir or --resume auto")
    if found.step >= 0:
        check_compatible(found, config, model, data_fingerprint)
        check_not_past(found, config)
        if mesh_shape is not None:
            check_numerics(found, config, model, mesh_shape)
    ckpt.set_aside(found, root)
    return found if found.step >= 0 else None


def finished(config, run_dir: Path, model_of) -> str | None:
    """Before any data is read or anything compiled: the one line that says this run has
    nothing left to do (its checkpoint is already at --steps), or None. `model_of(config)`
    gives the model, for the same compatibility checks a resume makes (a checkpoint of
    another computation is left to `find`'s errors)."""
    if config.checkpoint.resume == "none":
        return None
    # Sizes only: the hashes are checked once, by `find`, unless the run is already done.
    if config.checkpoint.resume == "auto":
        found = ckpt.latest_good(ckpt.checkpoint_root(run_dir), full=False)
    else:
        found = ckpt.resolve_explicit(config.checkpoint.resume, full=False)
    if found is None or found.step < config.optim.steps:
        return None
    if config.checkpoint.verify_checkpoint == "full" and ckpt.validate(found.path, full=True):
        return None  # corrupted: `find` says so and falls back (or refuses an explicit PATH)
    model = model_of(config)
    check_compatible(found, config, model)
    # The layout flags that change the numerics too (the mesh is not built yet: the saved
    # one stands in for a mixture-of-experts' micro-batch count).
    check_numerics(found, config, model, found.meta.get("mesh") or {})
    check_not_past(found, config)
    return (f"{found.path} is already at step {found.step} of --steps {config.optim.steps}: "
            f"nothing to train; pass --steps N above {found.step} to extend the run")


def check_not_past(found: ckpt.Found, config) -> None:
    require(found.step <= config.optim.steps,
            f"--resume: checkpoint {found.path} is at step {found.step}, past --steps "
            f"{config.optim.steps}; pass --steps {found.step} or more (more extends the run) "
            "or choose a new --run-dir")


def schedule_change(found: ckpt.Found | None, config, schedule) -> str | None:
    """The line that says a resumed run's --steps (so the learning-rate schedule's total)
    differs from the checkpoint's, or None."""
    was = (found.meta.get("config", {}) if found is not None else {}).get("steps")
    now = config.optim.steps
    if was is None or was == now:
        return None
    verb = "extending" if now > was else "shortening"
    return (f"resume: {verb} the run from --steps {was} to {now} at step {found.step}: the "
            f"learning-rate schedule now decays over {now} steps instead of {was} (lr "
            f"{float(schedule(found.step)):.3g} at step {found.step + 1})")


def start_state(plan: Plan, seed: int, found: ckpt.Found | None, init_from: str = "",
                offload_dir: Path | None = None) -> TrainState:
    """`initial_or_restored`; under `--offload disk` its moments then (re)written to their
    files under `offload_dir` (`jdist.step.moment_files`): a resume rewrites them from the
    checkpoint, so files left by a run that stopped mid-step are never read."""
    stacked = moment_files.stacked_keys(plan) if plan.on_disk else {}
    order = found.meta.get(CHECKPOINT_KEY) if found is not None else None
    if plan.on_disk and found is not None and found.meta.get(BASE_SAVED, True) and \
            list(order or range(plan.model.n_layers)) == list(range(plan.model.n_layers)):
        return restored_to_disk(found.path, plan, offload_dir, stacked)
    if plan.on_disk and found is None and not init_from:
        return init_on_disk(plan, seed, offload_dir)
    state = initial_or_restored(plan, seed, found, init_from)
    if not plan.on_disk:
        return state
    return state._replace(opt_state=moment_files.to_disk(state.opt_state, offload_dir,
                                                         stacked))


def restored_to_disk(path: Path, plan: Plan, offload_dir: Path, stacked: dict) -> TrainState:
    """`--offload disk` from a checkpoint in model layer order: the state but its moments,
    then each moment alone (Orbax partial restores), written to its file and freed before
    the next is read, so the whole moment tree is never on the devices."""
    moment = lambda p: keystr(p).startswith("['opt_state']") and \
        moment_files.param_key(p[1:]) is not None
    restore = lambda only: ckpt.restore_only(path, plan.abstract, plan.shardings, only)
    tree, files = restore(lambda p: not moment(p)), {}
    for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if moment(p):  # (a PLACEHOLDER leaf)
            leaf = dict(jax.tree_util.tree_flatten_with_path(
                restore(lambda q, p=p: q == p))[0])[p]
            files[p] = moment_files.write(
                leaf, offload_dir / moment_files.file_name(keystr(p[1:])),
                moment_files.param_key(p[1:]) in stacked)
            del leaf
    tree = jax.tree_util.tree_map_with_path(lambda p, x: files.get(p, x), tree)
    opt = jax.tree.unflatten(jax.tree.structure(plan.abstract.opt_state),
                             jax.tree.leaves(tree["opt_state"]))
    print(f"checkpoint: restored step {int(tree['step'])} from {path} into {offload_dir}, a "
          "moment at a time", flush=True)
    return TrainState(tree["step"], tree["params"], opt)


def initial_or_restored(plan: Plan, seed: int, found: ckpt.Found | None,
                        init_from: str = "") -> TrainState:
    """The initial state (random, or the Hugging Face checkpoint `init_from`), or the state
    restored from `found` laid out for this plan's mesh (and its stored layer order). A
    checkpoint of adapters only takes its frozen base from the initial state."""
    if found is not None and not found.meta.get(BASE_SAVED, True):
        base = initial_or_restored(plan, seed, None, init_from).params
        abstract, shardings = (saved_state(plan, t, save_base=False)
                               for t in (plan.abstract, plan.shardings))
        tree, _ = ckpt.restore(found.path, abstract, shardings)
        state = restore_order(plan, TrainState(**tree), found.meta.get(CHECKPOINT_KEY))
        return state._replace(params=trainable.with_base(state.params, base))
    if found is None and init_from:
        import time

        from jdist.hf.load import Source, load_params

        start, source = time.perf_counter(), Source(init_from)
        params = load_params(init_from, plan, source, init_adapters(plan, seed))
        state = state_from_params(plan, params)
        if jax.process_index() == 0:
            print(f"init: {init_from}: this process read {source.bytes_read / 2**20:,.1f} of "
                  f"{source.total_bytes() / 2**20:,.1f} MiB in "
                  f"{time.perf_counter() - start:.1f}s", flush=True)
        return state
    if found is None:
        return init_state(plan, seed)
    tree, _ = ckpt.restore(found.path, plan.abstract, plan.shardings)
    return restore_order(plan, TrainState(**tree), found.meta.get(CHECKPOINT_KEY))

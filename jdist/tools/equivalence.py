"""The equivalence harness: train a few steps on some mesh and compare with one device.

Every parallel feature is tested this way: same seed, same global batches, float32 with
matmul precision `highest` (GPUs otherwise multiply float32 in TF32). Per-step losses and
gradient norms, and the first step's gradients leaf by leaf, must match the single-device
run; the gradients are what a wrong reduction scale shows in (AdamW and global-norm
clipping are nearly invariant to it, so losses and parameters alone cannot see it).
"""

from __future__ import annotations

import dataclasses
import functools
import tempfile
from pathlib import Path

import jax
import numpy as np

from jdist import data
from jdist.config import TrainConfig
from jdist.models import ModelConfig
from jdist.parallel.pipeline import PipelineConfig
from jdist.parallel.pipeline.layer_order import to_model_order
from jdist.spmd.mesh import build_mesh, parse_mesh
from jdist.spmd.rules import DEFAULT_RULES, Rules
from jdist.step.build import make_train_step
from jdist.step.disk_update import init_on_disk
from jdist.step.from_flags import optimizer_of, plan_for
from jdist.step.state import (
    Plan,
    init_adapters,
    init_state,
    make_plan,
    state_from_params,
    with_pipeline,
)

RTOL = 1e-5  # float32: losses, gradient norms and each gradient leaf, relative


@dataclasses.dataclass
class RunResult:
    losses: np.ndarray      # [steps]
    grad_norms: np.ndarray  # [steps]
    grads: dict             # the first step's gradients (model layer order), numpy
    params: dict            # final parameters as numpy arrays (model layer order)
    lowered: object = None  # the step, lowered (compiled again only if `hlo` is read)

    @functools.cached_property
    def hlo(self) -> str:
        """The compiled step's HLO text (jdist.tools.hlo reads its collectives)."""
        return self.lowered.compile().as_text()


# The harness's own defaults where a test does not say: a few steps of a small batch.
# float32 unless a test says otherwise: `--compute-dtype auto` would be bfloat16 under
# QLoRA, and the harness compares at 1e-5.
HARNESS = {"steps": 3, "batch_size": 16, "seq_len": 32, "lr": 3e-3, "compute_dtype": "float32"}


def config(**flags) -> TrainConfig:
    """The flags of a harness run (`TrainConfig.of`'s flat names), the rest at the harness's
    defaults (HARNESS) or the trainer's."""
    return TrainConfig.of(**{**HARNESS, **flags})


def plan_of(mesh: str = "dp=1", **flags) -> Plan:
    """The Plan the command line makes for `--mesh mesh` and these flags (`model` defaults to
    tiny), through the one flags-to-plan path (`plan_for`: every `auto` resolved, every check
    run); made once per process for each set of flags (plans are immutable)."""
    return _plan_of(mesh, tuple(sorted(flags.items())))


@functools.cache
def _plan_of(mesh: str, flags: tuple) -> Plan:
    return plan_for(TrainConfig.of(**{"model": "tiny", "mesh": mesh, **dict(flags)}))[1]


def train_steps(model: ModelConfig, mesh, tokens: np.ndarray, flags: TrainConfig | None = None,
                rules: Rules = DEFAULT_RULES, pipeline: PipelineConfig | None = None,
                eod_id: int | None = None, batch_fn=None, grads_step: int = 0) -> RunResult:
    """Train `flags.optim.steps` steps (`flags`: a `config(...)`, default `config()`) of
    `model` on `mesh` (a Mesh or a mesh string; `flags.parallel.mesh` is not read, nor
    `--rules`: `rules` is the Rules themselves). The optimizer is `--optimizer` at `--lr`
    with 2 warmup steps over a `--schedule` of at least 10. `pipeline` (schedule, micro-batches)
    applies when the mesh has stages; `eod_id` packs documents (`jdist.data.packing`).
    `batch_fn(step)` -> host batch {"inputs", "targets"} replaces the token windows (tests
    of loss masks). `--init-from`: start from that Hugging Face directory's weights (`model`
    must be its config) instead of the seed's. `grads_step`: the step whose gradients are
    kept (LoRA's A gets its first nonzero gradient at step 1, once B has moved off zero)."""
    flags = flags or config()
    steps, seed = flags.optim.steps, flags.data.seed
    batch_size, seq_len, init_from = flags.data.batch_size, flags.data.seq_len, \
        flags.model.init_from
    if isinstance(mesh, str):
        mesh = build_mesh(mesh, jax.devices()[: parse_mesh(mesh).n_devices()])
    schedule_flags = dataclasses.replace(flags.optim, steps=max(steps, 10), warmup=2)
    tx, schedule = optimizer_of(dataclasses.replace(flags, optim=schedule_flags), model, mesh)
    plan = make_plan(model, mesh, rules, tx, flags.memory, flags.parallel, flags.finetune,
                     eod_id)
    plan = with_pipeline(plan, pipeline)
    losses, norms, first = [], [], None
    with jax.default_matmul_precision("highest"):
        if init_from:
            from jdist.hf.load import load_params

            params = load_params(init_from, plan, adapters=init_adapters(plan, 0))
            state = state_from_params(plan, params)
        elif plan.on_disk:  # --offload disk: the moments in files under --offload-dir
            state = init_on_disk(plan, seed, Path(flags.memory.offload_dir or tempfile.mkdtemp()))
        else:
            state = init_state(plan, seed)
        step = make_train_step(plan, schedule, return_grads=True)
        for i in range(steps):
            batch = data.global_batch(tokens, seed, i, batch_size, seq_len, plan.batch_sharding) \
                if batch_fn is None else jax.device_put(batch_fn(i), plan.batch_sharding)
            state, metrics, grads = step(state, batch)
            losses.append(metrics["loss"])
            norms.append(metrics["grad_norm"])
            if i == grads_step:
                first = to_model_order(plan, jax.tree.map(np.asarray, grads))
            del grads
        lowered = step.lower(state, batch)
    params = to_model_order(plan, jax.tree.map(np.asarray, state.params))
    return RunResult(np.array([float(x) for x in losses]), np.array([float(x) for x in norms]),
                     first, params, lowered)


def single_device() -> list:
    return jax.devices()[:1]


def mismatches(run: RunResult, reference: RunResult, rtol: float = RTOL) -> list[str]:
    """What differs from the reference beyond `rtol`: per-step loss and gradient norm, and
    each first-step gradient leaf (largest difference over the leaf's largest magnitude)."""
    out = []
    for name, a, b in (("loss", run.losses, reference.losses),
                       ("grad_norm", run.grad_norms, reference.grad_norms)):
        rel = np.abs(a - b) / np.abs(b)
        if rel.max() > rtol:
            out.append(f"{name} per step {a} vs {b} (rel {rel.max():.2e})")
    leaves = jax.tree_util.tree_leaves_with_path(reference.grads)
    mine = dict(jax.tree_util.tree_leaves_with_path(run.grads))
    for path, b in leaves:
        a = mine.get(path)
        if a is None or a.shape != b.shape:
            out.append(f"gradient {jax.tree_util.keystr(path)} missing or misshapen")
            continue
        rel = float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))
        if rel > rtol:
            out.append(f"gradient {jax.tree_util.keystr(path)} rel {rel:.2e}")
    return out


def assert_matches(run: RunResult, reference: RunResult, rtol: float = RTOL) -> None:
    problems = mismatches(run, reference, rtol)
    assert not problems, "; ".join(problems)


def loss_rel_diff(a: RunResult, b: RunResult) -> float:
    """Largest per-step relative difference of the losses."""
    return float(np.max(np.abs(a.losses - b.losses) / np.abs(b.losses)))


def param_abs_diff(a: RunResult, b: RunResult) -> float:
    """Largest absolute difference of any final parameter element."""
    diffs = jax.tree.map(lambda x, y: float(np.max(np.abs(x - y))), a.params, b.params)
    return max(jax.tree.leaves(diffs))

"""The equivalence harness: train a few steps on some mesh and compare with one device.

Every parallel feature is tested this way: same seed, same global batches, float32;
per-step losses and final parameters must match the single-device run.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jdist import data
from jdist.mesh import build_mesh, parse_mesh
from jdist.parallel.layer_order import to_model_order
from jdist.parallel.pipeline import PipelineConfig, with_pipeline
from jdist.rules import DEFAULT_RULES, Rules
from jdist.train.optim import make_optimizer
from jdist.train.state import init_state, make_plan
from jdist.train.step import make_train_step
from models import ModelConfig


@dataclasses.dataclass
class RunResult:
    losses: np.ndarray      # [steps]
    params: dict            # final parameters as numpy arrays
    hlo: str = ""           # the compiled step (jdist.hlo reads its collectives)


def train_steps(model: ModelConfig, mesh, tokens: np.ndarray, rules: Rules = DEFAULT_RULES,
                steps: int = 10, batch_size: int = 16, seq_len: int = 32, seed: int = 0,
                lr: float = 3e-3, compute_dtype=jnp.float32, zero: int = 0,
                grad_accum: int = 1, remat: str = "none", offload: bool = False,
                cp_strategy: str = "ring", pipeline: PipelineConfig | None = None) -> RunResult:
    """Train `steps` steps of `model` on `mesh` (a Mesh or a mesh string); `pipeline`
    (schedule, micro-batches) applies when the mesh has stages."""
    if isinstance(mesh, str):
        mesh = build_mesh(mesh, jax.devices()[: parse_mesh(mesh).n_devices()])
    tx, schedule = make_optimizer(lr, steps, warmup=2)
    plan = make_plan(model, mesh, rules, tx, zero=zero, offload_optimizer=offload,
                     cp_strategy=cp_strategy)
    plan = with_pipeline(plan, pipeline)
    state = init_state(plan, seed)
    step = make_train_step(plan, schedule, compute_dtype, grad_accum, remat)
    losses = []
    for i in range(steps):
        batch = data.global_batch(tokens, seed, i, batch_size, seq_len, plan.batch_sharding)
        state, metrics = step(state, batch)
        losses.append(metrics["loss"])
    hlo = step.lower(state, batch).compile().as_text()  # the executable just run, from cache
    params = to_model_order(plan, jax.tree.map(np.asarray, state.params))
    return RunResult(np.array([float(x) for x in losses]), params, hlo)


def single_device() -> list:
    return jax.devices()[:1]


def loss_rel_diff(a: RunResult, b: RunResult) -> float:
    """Largest per-step relative difference of the losses."""
    return float(np.max(np.abs(a.losses - b.losses) / np.abs(b.losses)))


def param_abs_diff(a: RunResult, b: RunResult) -> float:
    """Largest absolute difference of any final parameter element."""
    diffs = jax.tree.map(lambda x, y: float(np.max(np.abs(x - y))), a.params, b.params)
    return max(jax.tree.leaves(diffs))

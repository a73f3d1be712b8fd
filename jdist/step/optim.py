"""The optimizer: AdamW or Muon (`jdist.step.muon`) with linear warmup, then a cosine decay
or warmup-stable-decay, and global-norm clipping; and the non-finite guard `--on-nan skip`
wraps it in."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from jdist.step import muon

MIN_LR_RATIO = 0.1  # both schedules end at a tenth of the peak


class HostUpdate(NamedTuple):
    """The optimizer of `--offload params`: `init`/`update` are the elementwise part, run on
    the host under `compute_on("device_host")`, and the step clips the gradients to
    `clip_norm` on the device first. A host computation cannot run the clip's global norm
    (a collective: XLA CPU refuses its memory spaces, jax 0.10.2). The clip's place in the
    chain holds `optax.identity()`, whose state is the clip's (`EmptyState`): the state
    trees match, so checkpoints move between offload modes."""

    init: Callable
    update: Callable
    clip_norm: float

def lr_schedule(lr: float, steps: int, warmup: int, min_lr_ratio: float = MIN_LR_RATIO,
                kind: str = "cosine", decay_fraction: float = 0.2) -> optax.Schedule:
    """The learning rate at each count of updates (step k trains at count k - 1): linear over
    the first `warmup` steps, from lr / warmup at step 1 to lr at step `warmup` (0 and 1: lr
    from step 1), then a cosine to lr * min_lr_ratio one step past the last. A warmup that
    started at 0 would spend step 1 on nothing. `warmup` is cut to steps - 1. `kind` wsd:
    see `wsd`."""
    warmup = max(1, min(warmup, steps - 1))
    if kind == "wsd":
        return wsd(lr, steps, warmup, lr * min_lr_ratio, decay_fraction)
    return optax.warmup_cosine_decay_schedule(
        init_value=lr / warmup, peak_value=lr, warmup_steps=warmup - 1,
        decay_steps=max(steps, warmup), end_value=lr * min_lr_ratio)


def wsd(lr: float, steps: int, warmup: int, floor: float,
        decay_fraction: float) -> optax.Schedule:
    """Warmup-stable-decay: the same linear warmup (lr at step `warmup`), lr until the last
    `decay_fraction` of the steps (at least one), which decay to `floor` at the last step:
    unlike the cosine's, a WSD run's last weights are the decayed ones. The decay is 1 -
    sqrt of its progress, not linear: Hägele et al. 2024 ("Scaling Laws and Compute-Optimal
    Training Beyond Fixed Training Durations", arXiv 2405.18392) find it better than a
    linear cooldown, and it keeps lr high longer."""
    start = max(warmup - 1, steps - 1 - max(1, round(decay_fraction * steps)))
    rise = optax.linear_schedule(lr / warmup, lr, warmup - 1)

    def schedule(count):
        progress = jnp.clip((count - start) / max(steps - 1 - start, 1), 0.0, 1.0)
        return jnp.where(count < warmup - 1, rise(count),
                         floor + (lr - floor) * (1.0 - jnp.sqrt(progress)))
    return schedule


def make_optimizer(lr: float = 3e-3, steps: int = 1000, warmup: int = 100,
                   weight_decay: float = 0.1, clip_norm: float = 1.0,
                   b1: float = 0.9, b2: float = 0.95, optimizer: str = "adamw",
                   schedule: str = "cosine", decay_fraction: float = 0.2,
                   names: dict | None = None, mesh=None,
                   host: bool = False) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """Returns (transformation, schedule); the schedule reports the lr of each step. Muon
    needs the parameters' logical `names` (the model's tree) to tell matrices from the
    rest, and lays each matrix out on the `mesh`'s devices that orthogonalise it. `host`:
    a `HostUpdate` (`--offload params`)."""
    lr_at = lr_schedule(lr, steps, warmup, kind=schedule, decay_fraction=decay_fraction)
    adamw = optax.adamw(lr_at, b1=b1, b2=b2, weight_decay=weight_decay,
                        mask=lambda params: jax.tree_util.tree_map_with_path(_decays, params))
    if optimizer == "muon":
        assert names is not None, "Muon needs the parameters' logical names"
        adamw = muon.muon(lr_at, weight_decay, names, adamw, mesh)
    if host:
        return HostUpdate(*optax.chain(optax.identity(), adamw), clip_norm), lr_at
    return optax.chain(optax.clip_by_global_norm(clip_norm), adamw), lr_at


def skip_nonfinite(inner: optax.GradientTransformation) -> optax.GradientTransformation:
    """`--on-nan skip`: when the gradients are not all finite, the update is zero and the
    optimizer state is left as it was, its count of updates too: a skipped step does not
    advance the learning-rate schedule, just as a batch passed over after a rollback does
    not. Same state structure as `inner`, so checkpoints move freely between policies."""

    def update(grads, state, params=None):
        updates, new_state = inner.update(grads, state, params)
        ok = jnp.isfinite(optax.tree.norm(grads))
        updates = jax.tree.map(lambda u: jnp.where(ok, u, jnp.zeros_like(u)), updates)
        new_state = jax.tree.map(lambda n, o: jnp.where(ok, n, o), new_state, state)
        return updates, new_state

    return optax.GradientTransformation(inner.init, update)


def updates_applied(opt_state):
    """The optimizer's own count of updates, at which the schedule gives the learning rate
    of the next update. A skipped update (`--on-nan skip`, or a batch passed over after a
    rollback) does not advance it, so it lags the global step by the steps skipped. Works
    on any tree shaped like the optimizer state (e.g. its shardings). Muon's two halves
    count alike; the first is read."""
    return optax.tree_utils.tree_get_all_with_path(opt_state, "ScaleByScheduleState")[0][1].count


def _decays(path, p) -> bool:
    """Weight decay applies to weight matrices, not to normalisation scales."""
    return not any("norm" in str(getattr(k, "key", "")) for k in path)

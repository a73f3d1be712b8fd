"""The optimizer: AdamW with linear warmup, cosine decay and global-norm clipping; and the
non-finite guard `--on-nan skip` wraps it in."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax


def lr_schedule(lr: float, steps: int, warmup: int, min_lr_ratio: float = 0.1) -> optax.Schedule:
    """The learning rate at each count of updates (step k trains at count k - 1): linear over
    the first `warmup` steps, from lr / warmup at step 1 to lr at step `warmup` (0 and 1: lr
    from step 1), then a cosine to lr * min_lr_ratio one step past the last. A warmup that
    started at 0 would spend step 1 on nothing. `warmup` is cut to steps - 1."""
    warmup = max(1, min(warmup, steps - 1))
    return optax.warmup_cosine_decay_schedule(
        init_value=lr / warmup, peak_value=lr, warmup_steps=warmup - 1,
        decay_steps=max(steps, warmup), end_value=lr * min_lr_ratio)


def make_optimizer(lr: float = 3e-3, steps: int = 1000, warmup: int = 100,
                   weight_decay: float = 0.1, clip_norm: float = 1.0,
                   b1: float = 0.9, b2: float = 0.95) -> tuple[optax.GradientTransformation,
                                                               optax.Schedule]:
    """Returns (transformation, schedule); the schedule reports the lr of each step."""
    schedule = lr_schedule(lr, steps, warmup)
    tx = optax.chain(
        optax.clip_by_global_norm(clip_norm),
        optax.adamw(schedule, b1=b1, b2=b2, weight_decay=weight_decay,
                    mask=lambda params: jax.tree_util.tree_map_with_path(_decays, params)),
    )
    return tx, schedule


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
    on any tree shaped like the optimizer state (e.g. its shardings)."""
    return optax.tree_utils.tree_get(opt_state, "ScaleByScheduleState").count


def _decays(path, p) -> bool:
    """Weight decay applies to weight matrices, not to normalisation scales."""
    return not any("norm" in str(getattr(k, "key", "")) for k in path)

"""The split a pipeline stage's backward runs on (`jdist.parallel.pipeline.residuals`), on a small
layer loop of its own: what is stashed per micro-batch and what is recomputed from the
parameters, the backward rebuilt from them, and the input/weight halves of zero-bubble
schedules, each against `jax.vjp` of the same function. (The whole step's equivalence under
every schedule is tests/test_pipeline.py's.)"""

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from jdist.parallel.pipeline import residuals

LAYERS, D, ROWS = 3, 8, 5


def chunk(where, params, x, m, policy=jax.checkpoint_policies.everything_saveable):
    """A chunk as the stage program hands it over: `where` known per tick, `params` flat,
    `x` the micro-batch's input, `m` its index (here it picks a per-micro-batch scale)."""
    (scale,) = where
    w, norm = params
    bias = jnp.arange(4.0)[m]

    def layer(h, weights):
        w_l, n_l = weights
        cast = w_l.astype(jnp.bfloat16).astype(jnp.float32)  # depends on the weights only
        return jnp.tanh(checkpoint_name((h * n_l) @ cast, "proj")) + h, None

    body = jax.checkpoint(layer, policy=policy)
    y, _ = jax.lax.scan(body, x * scale + bias, (w, norm))
    return y, jnp.stack([jnp.sum(y**2), jnp.sum(y)])


def inputs():
    keys = jax.random.split(jax.random.key(0), 3)
    w = jax.random.normal(keys[0], (LAYERS, D, D)) / np.sqrt(D)
    norm = 1 + 0.1 * jax.random.normal(keys[1], (LAYERS, D))
    x = jax.random.normal(keys[2], (ROWS, D))
    cot = (jax.random.normal(keys[2], (ROWS, D)), jnp.array([0.5, -1.0]))
    return [jnp.float32(1.5)], [w, norm], x, jnp.int32(2), cot


def reference(where, params, x, m, cot):
    out, pullback = jax.vjp(lambda p, x: chunk(where, p, x, m), params, x)
    return out, pullback(cot)


def test_split_stashes_what_depends_on_the_micro_batch_and_pulls_back_exactly():
    where, params, x, m, cot = inputs()
    split = residuals.split(chunk, where, params, x, m)
    # The weights' bf16 round trip is the same for every micro-batch: computed again in the
    # backward tick, never stashed; the layer inputs are stashed.
    assert not all(split.stashed) and any(split.stashed)
    kept = {a.shape for a, s in zip(split.jaxpr.out_avals[2:], split.stashed) if not s}
    assert (LAYERS, D, D) in kept
    assert all(a.shape[1:] == (ROWS, D) for a in split.stash_avals() if a.ndim == 3)

    y, terms, stash = split.forward([*where, *params], x, m)
    (want_y, want_terms), (want_dp, want_dx) = reference(where, params, x, m, cot)
    np.testing.assert_array_equal(y, want_y)
    np.testing.assert_array_equal(terms, want_terms)
    # The backward from the stash alone: the chunk input is not passed again.
    d_p, d_x = split.pullback([*where, *params], stash)(cot)
    for a, b in zip([*d_p, d_x], [*want_dp, want_dx]):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


def test_halves_give_the_input_gradient_first_and_the_weights_from_its_hand_over():
    where, params, x, m, cot = inputs()
    split = residuals.split(chunk, where, params, x, m)
    halves = split.halves()
    _, _, stash = split.forward([*where, *params], x, m)
    res = split.residuals([*where, *params], stash)
    # Some residual is read only by the weight gradients (a layer's normalised input).
    assert not all(halves.b_reads) and any(halves.w_reads)
    early, handover = halves.input_half(res, cot)
    # The input's gradient is ready before any weight gradient runs.
    assert halves.early[-1]
    late = halves.weight_half(handover, res)
    *d_p, d_x = halves.merge(early, late)
    _, (want_dp, want_dx) = reference(where, params, x, m, cot)
    for a, b in zip([*d_p, d_x], [*want_dp, want_dx]):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
    # The weight half recomputes nothing of the input half: its hand-over carries the
    # per-layer cotangents, stacked over the loop's layers.
    assert any(a.shape[:1] == (LAYERS,) for a in halves.handover_avals())


def _dots(jaxpr) -> int:
    """dot_general equations in `jaxpr`, loop bodies included (once each)."""
    return sum(eqn.primitive.name == "dot_general" for eqn in jaxpr.eqns) + sum(
        _dots(getattr(sub, "jaxpr", sub)) for eqn in jaxpr.eqns for sub in eqn.params.values()
        if hasattr(getattr(sub, "jaxpr", sub), "eqns"))


def test_halves_split_a_layer_that_recomputes_its_forward():
    """Selective remat: the layer keeps its projection and recomputes the norm and tanh in
    the backward, so every residual feeds the input gradient. The weight half still gets
    the weight matmuls, reading the projection's cotangent handed over per layer and
    computing the (elementwise) normalised input again; neither half runs a matmul twice."""
    where, params, x, m, cot = inputs()
    selective = jax.checkpoint_policies.save_only_these_names("proj")
    fn = lambda w, p, x, m: chunk(w, p, x, m, selective)
    split = residuals.split(fn, where, params, x, m)
    halves = split.halves()
    _, _, stash = split.forward([*where, *params], x, m)
    res = split.residuals([*where, *params], stash)
    early, handover = halves.input_half(res, cot)
    late = halves.weight_half(handover, res)
    *d_p, d_x = halves.merge(early, late)
    _, pullback = jax.vjp(lambda p, x: fn(where, p, x, m), params, x)
    want_dp, want_dx = pullback(cot)
    for a, b in zip([*d_p, d_x], [*want_dp, want_dx]):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
    assert halves.early[-1] and not halves.early[0]  # the weight gradient comes late
    # One matmul per layer in each half: the input's gradient, then the weight's.
    assert _dots(halves.input_grad.jaxpr) == 1 and _dots(halves.weight_grad.jaxpr) == 1
    assert any(a.shape == (LAYERS, ROWS, D) for a in halves.handover_avals())

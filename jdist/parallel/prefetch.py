"""The layer loop with each layer's parameters gathered one layer ahead: layer i+1's
all-gather is in flight while layer i computes, in the forward and in the backward.

Autodiff of a `lax.scan` that carried the next layer's gathered weights would save that
carry for the backward: every layer's gathered weights, a full copy of the model per
device. So the loop has its own VJP (as the vocabulary loss has):

  forward   gather layer 0; each iteration starts gathering layer i+1, runs layer i under
            the remat policy and keeps what the policy saves, except the gathered weights
  backward  from the last layer (its weights gathered again): each iteration
            starts gathering layer i-1 and reducing layer i+1's weight gradient
            (`grad_sync.reduce`), and pulls the cotangent back through layer i (with the
            weights gathered again)

The weights the backward needs are recognised among a layer's residuals by identity: the
pullback of `jax.vjp` holds its inputs themselves (jax 0.10.2 and 0.12), and those are
dropped from what is stacked and put back, gathered again, when the layer is pulled back.

Memory over the plain loop: one more layer's gathered weights (the one in flight), and in
the backward one layer's unreduced float32 gradient while the next is produced.
Traffic: the forward's last iteration gathers the last layer again (a loop body cannot skip
a collective without a conditional, which would end the overlap), and the backward gathers
its last two layers itself rather than keep gathered weights from the forward (a pipeline
stage's stash would hold them per micro-batch); so a forward and backward gather 2n + 1
layers, one more than the plain loop (a forward alone n+1). With two layers the backward
takes both from the forward instead. The backward's first and last layers run outside its
loop. `applies` says when the loop runs (n > 1).

The code: `run` builds a `_Loop` (the call's layers and settings) and runs its custom VJP:
`_Loop.loop` (no gradient), `loop_fwd` (the forward keeping each layer's pullback) and
`loop_bwd`, whose layer steps are a `_Pullback`'s.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jdist.parallel import grad_sync as gs
from jdist.runtime.target import overlap_by_default


def run(layer, x, stored: dict, primal: dict, sync: dict, *, dtype, defer: bool, remat,
        stream: bool = False, grads_home: bool | None = None):
    """`layer(x, params) -> (x, stats)` over the stacked layers -> (x, stats [n, ...]).
    `stored`: the stored blocks [n, ...] (read); `primal`: their gradient-layout blocks
    (differentiated; None for a frozen leaf); `sync`: one layer's `grad_sync.Sync` per leaf;
    `remat`: the activation-checkpointing wrapper (`jdist.models.remat.wrapper`); `stream`:
    the blocks and their gradients live in host memory (`--offload params`): each layer is
    brought to the device where it is gathered, one ahead, and its reduced gradient goes
    back to the host, unless `grads_home` is False (a pipeline stage accumulates its
    gradients over ticks on the device: `jdist.step.pipelined`)."""
    trained = jax.tree.map(lambda p: p is not None, primal, is_leaf=lambda p: p is None)
    gather = functools.partial(_gather, stored, sync, trained, dtype, stream)
    # Closed-over values (the rotary tables, ...) become arguments: a custom VJP must not
    # close over values that autodiff traces.
    fn, consts = jax.closure_convert(
        lambda x, w, f: remat(layer)(x, merge(w, f, trained)), x,
        *jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), jax.eval_shape(gather, 0)))
    steps = _Loop(jax.tree.leaves(stored)[0].shape[0], gather, fn, sync, trained, primal,
                  defer, stream if grads_home is None else grads_home)
    loop = jax.custom_vjp(steps.loop)
    loop.defvjp(steps.loop_fwd, steps.loop_bwd)
    return loop(x, primal, consts)


def _gather(stored: dict, sync: dict, trained: dict, dtype, stream: bool, i) -> \
        tuple[dict, dict]:
    """Layer i's parameters as it computes with them, split (trained, frozen)."""
    whole = jax.tree.map(lambda s, y: gs.gather(to_device(lax.dynamic_index_in_dim(
        s, i, 0, keepdims=False), stream), y, dtype), stored, sync)
    return split(whole, trained)


def to_device(x, stream: bool = True):
    """`x` in device memory (from the host, when `stream`)."""
    return jax.device_put(x, jax.memory.Space.Device) if stream else x


def to_host(x, stream: bool = True):
    """`x` in host memory, when `stream`."""
    return jax.device_put(x, jax.memory.Space.Host) if stream else x


@dataclasses.dataclass(frozen=True, eq=False)
class _Loop:
    """One call's loop: its layers, and the custom VJP's three functions."""

    n: int                     # layers
    gather: Callable           # i -> layer i's gathered (trained, frozen) parameters
    fn: Callable               # (x, trained, frozen, *consts) -> (x, stats): one layer
    sync: dict
    trained: dict
    primal: dict               # the differentiated blocks: the gradients' tree and dtypes
    defer: bool
    grads_home: bool           # gradients to host memory (`run`'s `grads_home`)
    # How a layer's pullback is rebuilt from its stashed leaves: (tree, per leaf the index
    # of the weight or const it is, else None). Set by the forward's trace, read by the
    # backward's.
    where: list = dataclasses.field(default_factory=list)

    def loop(self, x, primal, consts):
        y, stats, _, _ = self.forward(x, consts, keep=False)
        return y, stats

    def loop_fwd(self, x, primal, consts):
        y, stats, kept, ends = self.forward(x, consts, keep=True)
        # Beyond two layers no gathered weights are handed to the backward: it gathers its
        # own first two. Kept, they would be two layers' gathered weights per micro-batch in
        # a pipeline's stash (jdist.parallel.pipeline.residuals). With two layers the backward's
        # gathers would repeat the forward's, which one compiler merges (CPU) and another
        # does not (GPU): keep those.
        return (y, stats), (kept, ends if self.n == 2 else None, consts)

    def loop_bwd(self, saved, cts):
        kept, ends, consts = saved
        n = self.n
        w_last, w_first = ends if n == 2 else (self.gather(n - 1), None)
        dy, dstats = cts
        pb = _Pullback(self, kept, dstats, consts, select(self.sync, self.trained))
        # Layer i's gradient is reduced in the iteration of layer i-1, whose backward hides
        # it: reduced where it is produced, the last of them (the first layers' projections)
        # would have no compute left beside it. The last layer is pulled back before the
        # loop (nothing to reduce yet), the first after it (nothing to prefetch), and the
        # first layer's gradient reduced last.
        grads = jax.tree.map(lambda p: to_host(jnp.zeros(p.shape, jnp.float32), self.grads_home),
                             self.primal)
        w = self.gather(n - 2) if n > 2 else w_first
        dx, pending, dconsts = pb.back(n - 1, dy, w_last, [jnp.zeros_like(c) for c in consts])
        if n > 2:
            (dx, w, pending, dconsts, grads), _ = lax.scan(
                pb.body, (dx, w, pending, dconsts, grads), jnp.arange(1, n - 1), reverse=True)
        grads = pb.put(grads, pending, 1)
        dx, pending, dconsts = pb.back(0, dx, w, dconsts)
        grads = pb.put(grads, pending, 0)
        grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, self.primal)
        return dx, grads, dconsts

    def forward(self, x, consts, keep: bool):
        """The layers in a scan, each iteration gathering the next layer's weights ->
        (y, stats, with `keep` each layer's stashed pullback, (last, first) weights)."""
        w_first = self.gather(0)
        (y, w_last), (stats, kept) = lax.scan(functools.partial(self.body, consts, keep),
                                              (x, w_first), jnp.arange(self.n))
        return y, stats, kept, (w_last, w_first)

    def body(self, consts, keep: bool, carry, i):
        """Layer i, with layer i+1's gathered weights in flight."""
        x, w = carry
        w_next = self.gather(jnp.minimum(i + 1, self.n - 1))
        if not keep:
            y, stats = self.fn(x, *w, *consts)
            return (y, w_next), (stats, None)
        # Differentiated in the trained weights only; the frozen ones are held.
        out, pullback = jax.vjp(lambda x, wt, *c: self.fn(x, wt, w[1], *c), x, w[0], *consts)
        return (out[0], w_next), (out[1], self.stash(pullback, w, consts))

    def stash(self, pullback, w, consts) -> list:
        """The pullback's leaves but the weights and consts it holds (by identity)."""
        leaves, tree = jax.tree.flatten(pullback)
        given = [*jax.tree.leaves(w), *consts]
        index = [next((j for j, g in enumerate(given) if leaf is g), None) for leaf in leaves]
        self.where[:] = [tree, index]
        return [leaf for leaf, j in zip(leaves, index) if j is None]

    def unstash(self, kept, w, consts):
        """A pullback from its stashed leaves and the weights (gathered again) and consts."""
        tree, index = self.where
        given, kept = [*jax.tree.leaves(w), *consts], iter(kept)
        return jax.tree.unflatten(tree, [next(kept) if j is None else given[j] for j in index])


@dataclasses.dataclass(frozen=True, eq=False)
class _Pullback:
    """One backward through the loop: what the forward stacked, and the cotangents."""

    steps: _Loop
    kept: list                 # per layer [n, ...]: the pullbacks' stashed leaves
    dstats: Any                # the stats' cotangents [n, ...]
    consts: list
    synced: dict               # the trained leaves' `grad_sync.Sync`

    def back(self, i, dx, w, dconsts):
        """Layer i pulled back: (dx, its unreduced weight gradient, dconsts)."""
        pull = self.steps.unstash(at(self.kept, i), w, self.consts)
        dx, dw, *dc = pull((dx, at(self.dstats, i)))
        return dx, dw, [a + b for a, b in zip(dconsts, dc)]

    def put(self, grads, dw, i):
        """Layer i's gradient reduced (`grad_sync.reduce`) into the stacked gradient."""
        return jax.tree.map(lambda acc, g, y: lax.dynamic_update_index_in_dim(
            acc, to_host(gs.reduce(g, y, self.steps.defer), self.steps.grads_home), i, 0),
            grads, dw, self.synced)

    def body(self, carry, i):
        """Layer i pulled back while layer i-1's weights are gathered and layer i+1's
        gradient is reduced."""
        dx, w, pending, dconsts, grads = carry
        w_prev = self.steps.gather(i - 1)
        grads = self.put(grads, pending, i + 1)
        dx, dw, dconsts = self.back(i, dx, w, dconsts)
        return (dx, w_prev, dw, dconsts, grads), None


def applies(setting: str, mesh, syncs, n_layers: int, stream: bool = False) -> bool:
    """Whether a loop of `n_layers` with these per-leaf `grad_sync.Sync`s prefetches:
    `--prefetch` on, or auto where `jdist.runtime.target.overlap_by_default` (NVIDIA GPUs); a next
    layer to gather; and a leaf that is gathered at all. Streamed from the host (`run`), it
    always does: the loop is what brings each layer in."""
    wanted = setting == "on" or (setting == "auto" and overlap_by_default(mesh))
    return n_layers > 1 and (stream or (wanted and any(y.gathers for y in syncs)))


def at(tree, i):
    """Entry i of a stacked tree."""
    return jax.tree.map(lambda r: lax.dynamic_index_in_dim(r, i, 0, keepdims=False), tree)


def split(tree: dict, trained: dict) -> tuple[dict, dict]:
    """(the trained leaves, the frozen ones) of a layer's tree: None where the other is."""
    # `trained` leads: a frozen leaf may be a subtree here (NF4 codes and scales).
    pick = lambda keep: jax.tree.map(lambda t, v: v if t == keep else None, trained, tree)
    return pick(True), pick(False)


def merge(trained_part: dict, frozen_part: dict, trained: dict) -> dict:
    return jax.tree.map(lambda t, a, b: a if t else b, trained, trained_part, frozen_part,
                        is_leaf=lambda v: v is None)


def select(tree: dict, trained: dict) -> dict:
    return split(tree, trained)[0]

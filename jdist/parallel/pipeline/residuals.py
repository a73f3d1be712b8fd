"""A chunk's forward split so that its backward can run ticks later without recomputing it:
the values the backward reads (the residuals `jax.vjp` keeps under the layer's `--remat`
policy), sorted into those that depend on the micro-batch, which a pipeline stage stashes
from the forward tick to the backward tick, and those computed from the parameters alone
(casts, broadcast norm scales, masks of an unpacked batch), which the backward tick computes
again instead of holding one copy per micro-batch in flight.

The split is jax's own partial evaluation of the forward-with-residuals jaxpr with the
micro-batch (chunk input and index) unknown: what it can evaluate from the parameters is
parameter-only. It reads three internals (`partial_eval_jaxpr_nounits`, `dce_jaxpr`,
`convert_constvars_jaxpr`, unchanged from jax 0.10.2 to 0.12) because no public API says
which outputs of a function depend on which inputs; a pullback rebuilt from the leaves is a
`jax.tree_util.Partial`, public.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
from jax._src.interpreters import partial_eval as pe  # see the module docstring
from jax.extend.core import jaxpr_as_fun

from jdist.parallel.pipeline import split_backward


@dataclasses.dataclass(frozen=True)
class Split:
    """`forward` -> (y, loss terms, stashed residuals); `pullback` pulls a cotangent back
    from the stashed residuals and the known inputs."""

    jaxpr: object           # ClosedJaxpr (*known, x, m) -> (y, terms, *residuals)
    params_only: object     # Jaxpr (*consts, *known) -> the parameter-only residuals
    params_consts: tuple
    backward: object        # Jaxpr (*residuals, cot_y, cot_terms) -> (*d_params, d_x)
    stashed: tuple[bool, ...]  # per residual: depends on the micro-batch

    def forward(self, known: list, x, m) -> tuple:
        y, terms, *res = jaxpr_as_fun(self.jaxpr)(*known, x, m)
        return y, terms, [r for r, s in zip(res, self.stashed) if s]

    def residuals(self, known: list, stash: list) -> list:
        """Every residual: the stashed ones (in order; None stands for one not needed) and
        the parameter-only ones, computed again."""
        fixed = iter(jax.core.eval_jaxpr(self.params_only, (), *self.params_consts, *known))
        held = iter(stash)
        return [next(held) if s else next(fixed) for s in self.stashed]

    def pullback(self, known: list, stash: list) -> Callable:
        """cotangent (of y, of terms) -> (gradients of the differentiated known inputs, of
        x)."""
        res = self.residuals(known, stash)

        def pull(cot):
            *d_params, d_x = jax.core.eval_jaxpr(self.backward, (), *res, *cot)
            return d_params, d_x
        return pull

    def halves(self) -> split_backward.Halves:
        """The backward split in two for zero-bubble schedules."""
        return split_backward.halves(self.backward, len(self.stashed))

    def stash_avals(self) -> list:
        res = self.jaxpr.out_avals[2:]
        return [a for a, s in zip(res, self.stashed) if s]


def split(fn: Callable, consts: list, params: list, x, m) -> Split:
    """`fn(consts, params, x, m) -> (y, terms)`, differentiated in `params` (a flat list of
    arrays) and `x`; `consts` and `params` are known before the micro-batch (`x`, `m`).
    The trace is abstract (nothing is computed)."""
    n_consts = len(consts)

    def with_residuals(*args):
        c, p, (x, m) = args[:n_consts], args[n_consts:-2], args[-2:]
        (y, terms), pullback = jax.vjp(lambda p, x: fn(list(c), p, x, m), list(p), x)
        leaves = jax.tree.leaves(pullback)
        # The backward as a jaxpr of its own trace: what the pullback closes over (a custom
        # VJP's saved operands, say) becomes its consts, returned here with the residuals,
        # so nothing of this trace is referenced after it ends.
        backward = jax.make_jaxpr(lambda res, cot: jax.tree.leaves(
            jax.tree.unflatten(jax.tree.structure(pullback), res)(cot)))(
                leaves, (jax.ShapeDtypeStruct(y.shape, y.dtype),
                         jax.ShapeDtypeStruct(terms.shape, terms.dtype)))
        box["backward"] = pe.convert_constvars_jaxpr(backward.jaxpr)
        return y, terms, *backward.consts, *leaves

    box = {}
    closed = jax.make_jaxpr(with_residuals)(*consts, *params, x, m)
    unknown = [False] * (n_consts + len(params)) + [True, True]
    known, _, out_unknown, _ = pe.partial_eval_jaxpr_nounits(closed, unknown, instantiate=False)
    # The known jaxpr returns its known outputs, then what it hands the unknown part (the
    # gathered weights, say): keep the parameter-only residuals, drop the rest unevaluated.
    # One whose recomputation communicates (a gathered weight carried out of a layer loop
    # is recomputed by the whole loop's gathers) is stashed instead.
    flat = pe.convert_constvars_jaxpr(known.jaxpr)
    n_out = len(flat.outvars)
    lead_known = sum(not u for u in out_unknown[:2])
    stashed, k = [], lead_known
    for unknown_res in out_unknown[2:]:
        if not unknown_res:
            alone, _ = pe.dce_jaxpr(flat, [i == k for i in range(n_out)])
            unknown_res = _communicates(alone)
            k += 1
        stashed.append(unknown_res)
    stash_known = iter(stashed[i] for i, u in enumerate(out_unknown[2:]) if not u)
    used = [False] * lead_known + [not next(stash_known) for u in out_unknown[2:] if not u]
    params_only, _ = pe.dce_jaxpr(flat, used + [False] * (n_out - len(used)),
                                  instantiate=True)
    return Split(closed, params_only, tuple(known.consts), box["backward"], tuple(stashed))


def _communicates(jaxpr) -> bool:
    """Whether `jaxpr` (or a jaxpr inside it: a loop's body, a branch) runs a collective."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name.startswith(split_backward.COLLECTIVES):
            return True
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns") and _communicates(inner):
                    return True
    return False

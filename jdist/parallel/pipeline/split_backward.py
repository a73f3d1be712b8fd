"""A chunk's backward split in two for zero-bubble schedules: the input half computes the
chunk input's gradient, which the previous stage waits for, and hands over what the weight
half needs to compute the parameter gradients ticks later, in what would be a bubble.

The split is driven by the outputs, through the layer loop: the input half is the backward
with everything its one output (the input gradient) does not need removed, inside each loop
body too. The weight half runs the rest, loop for loop, and reads three things:
- the forward's residuals, which it shares with the input half (the stage holds those until
  the weight half has run);
- what the input half computed and it needs, handed over: a loop's per-layer values stacked
  over the layers, as the loop's extra outputs. Cotangents always (they cannot be computed
  without the input half's chain through the layers), and forward values a matmul, a loop
  or a collective computed (an attention output, say);
- forward values a cheap elementwise chain computes from the residuals (a norm, an
  activation function), which it computes again rather than holding one per layer: what a
  remat policy like `selective` recomputes runs in both halves, but it is elementwise.
This works under every `--remat`: the weight gradients under `selective` read the layer's
recomputed forward, which the input half's dead-code removal cannot give them.

Calls into sub-jaxprs (`jit`, a checkpoint's body) are inlined first, so that a layer's
backward is visible to the split; other control flow (a `cond` choosing the loss's
backward) stays whole, in the half that needs its outputs first. The halves are rebuilt by
evaluating the backward's equations under `jax.make_jaxpr`, loops with `jax.lax.scan`; one
jax internal is read, an equation's bind parameters, as `jax.core.eval_jaxpr` does
(unchanged from jax 0.10.2 to 0.12).
"""

from __future__ import annotations

import dataclasses

import jax
from jax.extend.core import ClosedJaxpr, Var, jaxpr_as_fun

COLLECTIVES = ("all_gather", "psum", "reduce_scatter", "ppermute", "all_to_all", "pmax",
               "pmin")
INLINED = ("jit", "pjit", "closed_call", "core_call", "remat2", "checkpoint")
HEAVY = ("dot_general", "conv_general_dilated")  # never computed again by the weight half


@dataclasses.dataclass(frozen=True)
class Halves:
    """`input_grad` reads the residuals in `b_reads` and the cotangents, and returns the
    backward outputs in `early` (the chunk input's gradient, and any other the input half
    computes anyway), then the hand-over. `weight_grad` reads the hand-over and the
    residuals in `w_reads` and returns the other outputs."""

    input_grad: object          # ClosedJaxpr (*residuals b_reads, cot_y, cot_terms) -> ...
    weight_grad: object         # ClosedJaxpr (*hand-over, *residuals w_reads) -> ...
    b_reads: tuple[bool, ...]   # per residual
    w_reads: tuple[bool, ...]   # per residual: held until the weight half has run
    early: tuple[bool, ...]     # per backward output (*d_params, d_x)

    def handover_avals(self) -> list:
        return self.input_grad.out_avals[sum(self.early):]

    def input_half(self, residuals: list, cot: tuple) -> tuple[list, list]:
        """-> (the `early` outputs, the hand-over)."""
        mine = [r for r, b in zip(residuals, self.b_reads) if b]
        out = jaxpr_as_fun(self.input_grad)(*mine, *cot)
        n = sum(self.early)
        return out[:n], out[n:]

    def weight_half(self, handover: list, residuals: list) -> list:
        theirs = [r for r, w in zip(residuals, self.w_reads) if w]
        return jaxpr_as_fun(self.weight_grad)(*handover, *theirs)

    def merge(self, early: list, late: list) -> list:
        """All backward outputs in order, from the two halves'."""
        early, late = iter(early), iter(late)
        return [next(early) if e else next(late) for e in self.early]


def halves(backward, n_res: int) -> Halves:
    """`backward`: a Jaxpr (*residuals, cot_y, cot_terms) -> (*d_params, d_x)."""
    closed = _inlined(backward)
    jaxpr, consts = closed.jaxpr, dict(zip(closed.jaxpr.constvars, closed.consts))
    n_out, n_in = len(jaxpr.outvars), len(jaxpr.invars)
    cot = [i >= n_res for i in range(n_in)]
    live, _ = _live(jaxpr, [False] * (n_out - 1) + [True], cot)
    made = _made_by(jaxpr, live)
    # What the input half computes anyway is returned by it, not handed over.
    early = [i == n_out - 1 or not isinstance(v, Var) or v in made or v in jaxpr.invars
             for i, v in enumerate(jaxpr.outvars)]
    plan = _plan(jaxpr, early, [not e for e in early], cot, cot)
    b_reads = tuple(plan.b_in[:n_res])
    w_reads = tuple(plan.w_in[:n_res])

    def input_grad(*args):
        env = dict(consts)
        env.update((v, a) for v, a in zip(
            [v for v, b in zip(jaxpr.invars, b_reads + (True, True)) if b], args))
        _run_input(jaxpr, plan, env)
        return [_read(env, v) for v, e in zip(jaxpr.outvars, early) if e] + \
            [env[k] for k in plan.handover]

    b_avals = [v.aval for v, b in zip(jaxpr.invars, b_reads + (True, True)) if b]
    b_closed = jax.make_jaxpr(input_grad)(*b_avals)
    n_early = sum(early)

    def weight_grad(*args):
        env = dict(consts)
        env.update(zip(plan.handover, args[:len(plan.handover)]))
        env.update(zip([v for v, w in zip(jaxpr.invars, w_reads) if w],
                       args[len(plan.handover):]))
        _run_weight(jaxpr, plan, env)
        return [_read(env, v) for v, e in zip(jaxpr.outvars, early) if not e]

    w_closed = jax.make_jaxpr(weight_grad)(
        *b_closed.out_avals[n_early:],
        *[v.aval for v, w in zip(jaxpr.invars[:n_res], w_reads) if w])
    return Halves(b_closed, w_closed, b_reads, w_reads, tuple(early))


# --- what each half runs ---------------------------------------------------------------

@dataclasses.dataclass
class _Plan:
    """One jaxpr's split. `live`: equation index -> which of its outputs the input half
    computes. `weight`: equation index -> which outputs the weight half computes (None:
    the whole equation, its own or one it computes again). `loops`: the split of each loop
    the input half runs. `handover`: what the input half hands over, a var of this jaxpr or
    (loop index, k), the k-th of that loop's stacked hand-overs. `b_in`/`w_in`: the
    jaxpr's inputs each half reads."""

    live: dict
    weight: dict
    loops: dict
    handover: list
    b_in: list
    w_in: list


@dataclasses.dataclass
class _Loop:
    body: _Plan
    b_out: list     # the loop's outputs the input half computes (its carries first)
    b_carry: list   # the carries the input half runs
    w_carry: list   # the carries the weight half runs
    w_out: list     # the loop's outputs the weight half computes


def _plan(jaxpr, early: list, late: list, taint: list, from_input: list) -> _Plan:
    """`early`/`late`: the outputs each half returns. `taint`: inputs that are cotangents
    (or computed from them). `from_input`: inputs the weight half gets only by hand-over (the
    cotangents; in a loop body, the input half's carries)."""
    live, b_in = _live(jaxpr, early, taint)
    tainted = _tainted(jaxpr, taint)
    need = {v for v, w in zip(jaxpr.outvars, late) if w and isinstance(v, Var)}
    weight, loops, handover = {}, {}, []

    def hand(key):
        if key not in handover:
            handover.append(key)

    for i in reversed(range(len(jaxpr.eqns))):
        eqn = jaxpr.eqns[i]
        wanted = [v in need for v in eqn.outvars]
        if i in live and eqn.primitive.name == "scan":
            rest = [w and not b for w, b in zip(wanted, live[i])]
            loops[i], used = _split_loop(eqn, live[i], rest, tainted)
            for v, w, b in zip(eqn.outvars, wanted, live[i]):
                if w and b:
                    hand(v)
            if any(rest):
                weight[i] = loops[i].w_out
                need.update(v for v, u in zip(eqn.invars, used) if u and isinstance(v, Var))
            for k in range(len(loops[i].body.handover)):
                hand((i, k))
            continue
        if not any(wanted):
            continue
        if i in live and not _recomputable(eqn, tainted):
            for v, w in zip(eqn.outvars, wanted):
                if w:
                    hand(v)
            continue
        weight[i] = None  # the weight half's own, or cheap enough to compute again
        need.update(v for v in eqn.invars if isinstance(v, Var))
    for v, b in zip(jaxpr.invars, from_input):
        if v in need and b:
            hand(v)
    w_in = [v in need and not b for v, b in zip(jaxpr.invars, from_input)]
    return _Plan(live, weight, loops, handover, b_in, w_in)


def _split_loop(eqn, live: list, rest: list, tainted: set) -> tuple[_Loop, list]:
    """A loop the input half runs, with `rest`: the outputs only the weight half wants.
    Returns the split and which of the loop's inputs the weight half reads."""
    (nc, nk), body = _counts(eqn), eqn.params["jaxpr"].jaxpr
    body_taint = _body_taint(eqn, [isinstance(v, Var) and v in tainted for v in eqn.invars])
    b_carry, w_carry = live[:nk], rest[:nk]
    nx = len(eqn.invars) - nc - nk
    while True:
        plan = _plan(body, b_carry + live[nk:], w_carry + rest[nk:], body_taint,
                     [False] * nc + b_carry + [False] * nx)
        # The weight half runs every carry it reads that the input half does not.
        more = [w or r for w, r in zip(w_carry, plan.w_in[nc:nc + nk])]
        if more == w_carry:
            break
        w_carry = more
    used = plan.w_in[:nc] + w_carry + plan.w_in[nc + nk:]
    return _Loop(plan, live, b_carry, w_carry, w_carry + rest[nk:]), used


def _recomputable(eqn, tainted: set) -> bool:
    """Whether the weight half computes `eqn` again rather than have it handed over: a cheap
    equation of forward values only."""
    name = eqn.primitive.name
    return not (any(isinstance(v, Var) and v in tainted for v in eqn.outvars)
                or name in HEAVY or name.startswith(COLLECTIVES) or "custom" in name
                or _subjaxprs(eqn))


def _live(jaxpr, outs: list, taint: list | None = None) -> tuple[dict, list]:
    """Dead-code analysis through loops: equation index -> which outputs `outs` need, and
    which inputs they read. With `taint` (the inputs that are cotangents), the input half's:
    it also computes every matmul of forward values the backward runs, so that the weight
    half is handed the product (an attention output) rather than computing it again from
    larger operands (the attention probabilities)."""
    need = {v for v, o in zip(jaxpr.outvars, outs) if o and isinstance(v, Var)}
    tainted = set()
    if taint is not None:
        tainted = _tainted(jaxpr, taint)
        every, _ = _live(jaxpr, [True] * len(jaxpr.outvars))
        need.update(v for i in every for v in jaxpr.eqns[i].outvars
                    if _forward_matmul(jaxpr.eqns[i], tainted))
    live = {}
    for i in reversed(range(len(jaxpr.eqns))):
        eqn = jaxpr.eqns[i]
        mask = [v in need for v in eqn.outvars]
        if not any(mask):
            continue
        if eqn.primitive.name == "scan":
            ins = None if taint is None else [isinstance(v, Var) and v in tainted
                                              for v in eqn.invars]
            mask, used = _live_loop(eqn, mask, ins)
        else:
            mask, used = [True] * len(mask), [True] * len(eqn.invars)
        live[i] = mask
        need.update(v for v, u in zip(eqn.invars, used) if u and isinstance(v, Var))
    return live, [v in need for v in jaxpr.invars]


def _live_loop(eqn, mask: list, taint: list | None) -> tuple[list, list]:
    (nc, nk), body = _counts(eqn), eqn.params["jaxpr"].jaxpr
    inner = None if taint is None else _body_taint(eqn, taint)
    carry = mask[:nk]
    while True:
        _, used = _live(body, carry + mask[nk:], inner)
        more = [c or u for c, u in zip(carry, used[nc:nc + nk])]
        if more == carry:
            return carry + mask[nk:], used[:nc] + carry + used[nc + nk:]
        carry = more


def _forward_matmul(eqn, tainted: set) -> bool:
    return (eqn.primitive.name in HEAVY or "custom" in eqn.primitive.name) and not any(
        isinstance(v, Var) and v in tainted for v in eqn.outvars)


def _tainted(jaxpr, taint: list) -> set:
    """The vars computed from the inputs marked in `taint`."""
    out = {v for v, t in zip(jaxpr.invars, taint) if t}
    for eqn in jaxpr.eqns:
        ins = [isinstance(v, Var) and v in out for v in eqn.invars]
        flags = _loop_taint(eqn, ins) if eqn.primitive.name == "scan" else \
            [any(ins)] * len(eqn.outvars)
        out.update(v for v, t in zip(eqn.outvars, flags) if t)
    return out


def _loop_taint(eqn, ins: list) -> list:
    """Which of a loop's outputs are tainted, given which of its inputs are."""
    body = eqn.params["jaxpr"].jaxpr
    inner = _tainted(body, _body_taint(eqn, ins))
    return [isinstance(v, Var) and v in inner for v in body.outvars]


def _body_taint(eqn, ins: list) -> list:
    """Which of a loop body's inputs are tainted: a carry is, once any iteration taints it."""
    (nc, nk), body = _counts(eqn), eqn.params["jaxpr"].jaxpr
    carry = ins[nc:nc + nk]
    while True:
        inner = _tainted(body, ins[:nc] + carry + ins[nc + nk:])
        more = [c or (isinstance(v, Var) and v in inner) for c, v in zip(carry, body.outvars)]
        if more == carry:
            return ins[:nc] + carry + ins[nc + nk:]
        carry = more


def _made_by(jaxpr, live: dict) -> set:
    """The vars the input half computes."""
    return {v for i, mask in live.items() for v, m in zip(jaxpr.eqns[i].outvars, mask) if m}


# --- running them ----------------------------------------------------------------------

def _run_input(jaxpr, plan: _Plan, env: dict) -> None:
    for i, eqn in enumerate(jaxpr.eqns):
        if i not in plan.live:
            continue
        if i in plan.loops:
            _input_loop(eqn, i, plan.loops[i], env)
        else:
            _write(env, eqn.outvars, _bind(eqn, [_read(env, v) for v in eqn.invars]))


def _run_weight(jaxpr, plan: _Plan, env: dict) -> None:
    for i, eqn in enumerate(jaxpr.eqns):
        if i not in plan.weight:
            continue
        if plan.weight[i] is None:
            _write(env, eqn.outvars, _bind(eqn, [_read(env, v) for v in eqn.invars]))
        else:
            _weight_loop(eqn, i, plan.loops[i], env)


def _input_loop(eqn, i: int, loop: _Loop, env: dict) -> None:
    """The loop's input half: its live carries and outputs, and its per-iteration hand-over
    stacked as extra outputs under keys (i, k)."""
    nk = _counts(eqn)[1]
    stacks = _half_loop(eqn, _run_input, loop.body, loop.body.b_in, loop.b_carry,
                        loop.b_out[nk:], env, hands_over=loop.body.handover)
    env.update(((i, k), s) for k, s in enumerate(stacks))


def _weight_loop(eqn, i: int, loop: _Loop, env: dict) -> None:
    """The loop's weight half, reading the input half's stacked hand-over per iteration."""
    nk, handover = _counts(eqn)[1], loop.body.handover
    _half_loop(eqn, _run_weight, loop.body, loop.body.w_in, loop.w_carry, loop.w_out[nk:],
               env, handed=(handover, [env[(i, k)] for k in range(len(handover))]))


def _half_loop(eqn, run, plan: _Plan, reads: list, carried: list, kept_ys: list, env: dict,
               handed: tuple = ((), ()), hands_over: list = ()) -> list:
    """One half of a split loop as a `lax.scan`: `run` (`_run_input`/`_run_weight`) over
    the body by `plan`, reading the consts and xs marked in `reads` and running the carries
    marked in `carried`; writes the loop outputs it computes (those carries, the ys marked
    in `kept_ys`) to `env`. `handed`: (body keys, their stacked values) read per iteration;
    returns the body values of `hands_over`, stacked."""
    (p, body), (nc, nk) = (eqn.params, eqn.params["jaxpr"]), _counts(eqn)
    jx = body.jaxpr
    ins = list(zip(jx.invars, eqn.invars, reads))
    consts = [(v, _read(env, o)) for v, o, u in ins[:nc] if u]
    carry = [(v, _read(env, o)) for (v, o, _), c in zip(ins[nc:nc + nk], carried) if c]
    xs = [(v, _read(env, o)) for v, o, u in ins[nc + nk:] if u]
    keys, stacks = handed

    def step(c, x):
        xs_now, handed_now = x
        local = dict(zip(jx.constvars, body.consts))
        local.update(consts)
        local.update(zip([v for v, _ in carry], c))
        local.update(zip([v for v, _ in xs], xs_now))
        local.update(zip(keys, handed_now))
        run(jx, plan, local)
        c_out = [_read(local, v) for v, k in zip(jx.outvars[:nk], carried) if k]
        ys = [_read(local, v) for v, k in zip(jx.outvars[nk:], kept_ys) if k]
        return c_out, (ys, [local[k] for k in hands_over])

    c, (ys, out) = jax.lax.scan(step, [a for _, a in carry], ([a for _, a in xs], list(stacks)),
                                length=p["length"], reverse=p["reverse"], unroll=p["unroll"])
    _write(env, [v for v, k in zip(eqn.outvars[:nk], carried) if k], c)
    _write(env, [v for v, k in zip(eqn.outvars[nk:], kept_ys) if k], ys)
    return out


# --- evaluating equations --------------------------------------------------------------

def _inlined(jaxpr) -> ClosedJaxpr:
    """`jaxpr` with calls (`jit`, checkpoints) replaced by their bodies, loops' too."""
    return jax.make_jaxpr(lambda *args: _eval(jaxpr, (), args))(
        *(v.aval for v in jaxpr.invars))


def _eval(jaxpr, consts, args) -> list:
    env = dict(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))
    for eqn in jaxpr.eqns:
        ins = [_read(env, v) for v in eqn.invars]
        name = eqn.primitive.name
        if name in INLINED:
            (sub,) = _subjaxprs(eqn)
            out = _eval(getattr(sub, "jaxpr", sub), getattr(sub, "consts", ()), ins)
        elif name == "scan":
            out = _scan(eqn, ins)
        else:
            out = _bind(eqn, ins)
        _write(env, eqn.outvars, out)
    return [_read(env, v) for v in jaxpr.outvars]


def _scan(eqn, ins: list) -> list:
    (p, body), (nc, nk) = (eqn.params, eqn.params["jaxpr"]), _counts(eqn)

    def step(c, x):
        out = _eval(body.jaxpr, body.consts, [*ins[:nc], *c, *x])
        return out[:nk], out[nk:]

    c, ys = jax.lax.scan(step, ins[nc:nc + nk], ins[nc + nk:], length=p["length"],
                         reverse=p["reverse"], unroll=p["unroll"])
    return [*c, *ys]


def _counts(eqn) -> tuple[int, int]:
    """A loop's numbers of consts and carries (jax 0.12 gives their tree, not the counts)."""
    p = eqn.params
    if "num_consts" in p:
        return p["num_consts"], p["num_carry"]
    consts, carry, _ = p["ft_in"].unpack()
    return len(consts), len(carry)


def _bind(eqn, ins: list) -> list:
    params = eqn.primitive.get_bind_params(eqn.params)  # as jax.core.eval_jaxpr
    with eqn.ctx.manager:
        out = eqn.primitive.bind(*ins, **params)
    return out if eqn.primitive.multiple_results else [out]


def _subjaxprs(eqn) -> list:
    return [sub for param in eqn.params.values()
            for sub in (param if isinstance(param, (tuple, list)) else (param,))
            if hasattr(getattr(sub, "jaxpr", sub), "eqns")]


def _read(env: dict, v):
    return env[v] if isinstance(v, Var) else v.val


def _write(env: dict, outvars, values) -> None:
    env.update((v, x) for v, x in zip(outvars, values) if isinstance(v, Var))

"""An anchor outside jdist: the one-device training step against `jax.grad` of a plain
cross-entropy written here, through the model's own modules called one by one.

Every layout is tested against jdist's one-device step (`jdist.tools.equivalence`); this checks
that step itself. The reference shares only the model definition (`models`) with jdist:
no `jdist.train`, `jdist.models.loss` or `jdist.parallel` code computes it, so a mistake in the
step's loss normalisation, masking, embedding lookup or gradient plumbing shows here even
though every layout would agree with it.
"""

import operator

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jdist.models.loss
from jdist.models import Llama
from jdist.models.context import LOCAL
from jdist.models.layers import rotary_tables
from jdist.step.build import make_train_step
from jdist.step.state import init_state
from jdist.tools.equivalence import plan_of

BATCH, SEQ = 4, 32
IGNORED = -1  # jdist's mark for a target the loss does not count (jdist.models.loss.IGNORE)
RTOL = 1e-6  # float32 at matmul precision "highest": both sides sum in a different order


def masked_batch(tokens: np.ndarray) -> dict:
    """Windows of real text with a different prefix of each row's targets ignored (row r
    loses 7r of its targets), so counted tokens (not all tokens) set the mean."""
    starts = np.arange(BATCH) * 9_973  # spread over the corpus
    windows = np.stack([tokens[s: s + SEQ + 1] for s in starts]).astype(np.int32)
    targets = windows[:, 1:].copy()
    targets[np.arange(SEQ)[None, :] < 7 * np.arange(BATCH)[:, None]] = IGNORED
    return {"inputs": windows[:, :-1], "targets": targets}


def balance_penalty(stats: dict, cfg) -> jax.Array:
    """One MoE layer's weighted Switch load-balancing loss E * sum_e f_e * P_e (f_e: the
    fraction of the layer's top-k assignments that went to expert e, P_e: its mean router
    probability) plus the router z-loss (mean squared logsumexp of the router logits), from
    the sums the layer reports."""
    tokens = stats["tokens"]
    fraction, mean_prob = stats["counts"] / (tokens * cfg.top_k), stats["prob_sum"] / tokens
    return (cfg.aux_loss_weight * cfg.n_experts * jnp.sum(fraction * mean_prob)
            + cfg.z_loss_weight * stats["z_sum"] / tokens)


def reference_loss(params: dict, cfg, inputs, targets) -> jax.Array:
    """Mean cross-entropy over the counted targets, through the model's modules: embedding
    rows, each layer's block in turn, final norm, head, log-softmax; for MoE models plus
    the balance penalties averaged over the layers."""
    graphdef, state = nnx.split(nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0))))
    nnx.replace_by_pure_dict(state, params)
    model = nnx.merge(graphdef, state)
    x = model.embed[...][inputs]
    cos, sin = rotary_tables(np.arange(inputs.shape[1]), cfg.dim_per_head, cfg.rope_theta,
                             cfg.rope_scaling)
    block_def, stacked = nnx.split(model.blocks)
    penalties = []
    for layer in range(cfg.n_layers):
        block = nnx.merge(block_def, jax.tree.map(operator.itemgetter(layer), stacked))
        x, stats = block(x, cos, sin, LOCAL)
        penalties += [balance_penalty(stats, cfg)] if stats else []
    head = model.embed[...].T if cfg.tie_embeddings else model.head[...]
    log_probs = jax.nn.log_softmax(model.final_norm(x) @ head, axis=-1)
    counted = targets != IGNORED
    picked = jnp.take_along_axis(log_probs, jnp.where(counted, targets, 0)[..., None], -1)
    ce = -jnp.sum(jnp.where(counted, picked[..., 0], 0.0)) / jnp.sum(counted)
    return ce + sum(penalties) / cfg.n_layers if penalties else ce


def jdist_step(plan, batch: dict) -> tuple[dict, float, dict]:
    """(initial parameters, loss, gradients) of jdist's first training step on one device,
    with its default settings (chunked loss, attention chosen automatically)."""
    state = init_state(plan, seed=0)
    params = jax.tree.map(np.asarray, state.params)  # before the step donates them
    _, metrics, grads = make_train_step(plan, return_grads=True)(
        state, jax.device_put(batch, plan.batch_sharding))
    return params, float(metrics["loss"]), jax.tree.map(np.asarray, grads)


def mismatches(batch: dict, rtol: float = RTOL, **flags) -> list[str]:
    """Where jdist's one-device step for these flags (the tiny model by default) differs from
    the reference beyond `rtol`: the loss, and each gradient leaf (largest difference over
    the leaf's largest magnitude)."""
    plan = plan_of("dp=1", batch_size=BATCH, seq_len=SEQ, **flags)
    cfg = plan.model
    with jax.default_matmul_precision("highest"):
        params, loss, grads = jdist_step(plan, batch)
        ref_loss, ref_grads = jax.jit(jax.value_and_grad(reference_loss), static_argnums=1)(
            params, cfg, batch["inputs"], batch["targets"])
    out = []
    rel = abs(loss - float(ref_loss)) / abs(float(ref_loss))
    if rel > rtol:
        out.append(f"loss {loss} vs {float(ref_loss)} (rel {rel:.2e})")
    mine = dict(jax.tree_util.tree_leaves_with_path(grads))
    for path, ref in jax.tree_util.tree_leaves_with_path(ref_grads):
        name, got = jax.tree_util.keystr(path), mine.pop(path, None)
        if got is None or got.shape != ref.shape:
            out.append(f"gradient {name} missing or misshapen")
            continue
        rel = float(np.max(np.abs(got - ref)) / max(float(np.max(np.abs(ref))), 1e-30))
        if rel > rtol:
            out.append(f"gradient {name} rel {rel:.2e}")
    out += [f"gradient {jax.tree_util.keystr(p)} not in the reference" for p in mine]
    return out


@pytest.fixture(scope="module")
def batch(corpus) -> dict:
    return masked_batch(corpus.train)


def test_batch_has_ignored_targets(batch):
    counted = (batch["targets"] != IGNORED).sum()
    assert 0 < counted < batch["targets"].size
    assert IGNORED == jdist.models.loss.IGNORE


def test_one_device_step_matches_plain_jax_grad(batch):
    problems = mismatches(batch)
    assert not problems, "; ".join(problems)


def test_tied_embeddings_match_plain_jax_grad(batch):
    """The table serves as embedding and head: its gradient is the sum of both uses."""
    problems = mismatches(batch, tie_embeddings=True, n_layers=1)
    assert not problems, "; ".join(problems)


def test_moe_step_matches_plain_jax_grad(batch):
    """The routed experts, and the objective's balance penalties, on one device."""
    problems = mismatches(batch, model="moe-tiny")
    assert not problems, "; ".join(problems)


def mean_over_all_tokens(monkeypatch):
    monkeypatch.setattr(jdist.models.loss, "token_count", lambda targets: jnp.int32(targets.size))


def scale_off_by_1e5(monkeypatch):
    """Ten times the tolerance: the comparison must resolve errors this small."""
    right = jdist.models.loss.piece_scale
    monkeypatch.setattr(jdist.models.loss, "piece_scale",
                        lambda pieces, count: right(pieces, count) * (1 + 1e-5))


@pytest.mark.parametrize("break_normalisation", [mean_over_all_tokens, scale_off_by_1e5])
def test_comparison_catches_a_wrong_normalisation(batch, monkeypatch, break_normalisation):
    """Negative control: with jdist's loss normalisation broken the comparison must fail,
    on the loss and on the gradients (each is scaled by the same wrong factor)."""
    break_normalisation(monkeypatch)
    problems = mismatches(batch)
    assert any(p.startswith("loss") for p in problems), problems
    assert any(p.startswith("gradient ['head']") for p in problems), problems

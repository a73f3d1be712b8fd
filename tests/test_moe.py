"""Mixture of experts: the expert-parallel layer against a plain loop over experts, end-to-end
equivalence with one device, dropping under low capacity, all-to-all in the HLO; the grouped
dropless path's block layout, executed FLOPs and equivalence with the padded path."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jdist.config import TrainConfig
from jdist.models import get_preset, grouped
from jdist.models import loss as objective
from jdist.models.moe import local_moe, rebalanced_bias, route
from jdist.parallel.moe import OVERLAP_PIECES, moe_ffn
from jdist.spmd.mesh import build_mesh
from jdist.spmd.rules import DEFAULT_RULES
from jdist.step import make_train_step
from jdist.tools.equivalence import assert_matches, config, plan_of, train_steps
from jdist.tools.gpu_report import report
from jdist.tools.hlo import collective_counts, loop_bodies
from jdist.train.__main__ import main
from jdist.train.loop import train

MOE = get_preset("moe-tiny")


def reference_moe(x, w, cfg):
    """Per token: softmax router, top-k renormalised, sum of the chosen experts' SwiGLU."""
    logits = x @ w["router"]
    probs = jax.nn.softmax(logits)
    top, idx = jax.lax.top_k(probs, cfg.top_k)
    if cfg.norm_topk_prob:
        top = top / top.sum(-1, keepdims=True)
    y = jnp.zeros_like(x)
    for e in range(cfg.n_experts):
        h = jax.nn.silu(x @ w["w_gate"][e]) * (x @ w["w_up"][e])
        weight = jnp.sum(jnp.where(idx == e, top, 0.0), axis=-1, keepdims=True)
        y = y + weight * (h @ w["w_down"][e])
    return y


def random_layer(seed=0, b=8, s=16):
    keys = jax.random.split(jax.random.key(seed), 5)
    d, f, e = MOE.d_model, MOE.d_ff, MOE.n_experts
    w = {"router": jax.random.normal(keys[0], (d, e)) * 0.5,
         "w_gate": jax.random.normal(keys[1], (e, d, f)) / d ** 0.5,
         "w_up": jax.random.normal(keys[2], (e, d, f)) / d ** 0.5,
         "w_down": jax.random.normal(keys[3], (e, f, d)) / f ** 0.5}
    return jax.random.normal(keys[4], (b, s, d)), w


def rel(a, b):
    return float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)))


@pytest.mark.parametrize("mesh, routing, renormalised", [
    ("ep=8", "dropless", True), ("ep=8", "capacity", True), ("dp=2,ep=2,tp=2", "dropless", True),
    ("dp=2,ep=2,tp=2", "capacity", True), ("dp=2,fsdp=2,tp=2", "grouped", True),
    ("ep=8", "grouped", True), ("dp=2,ep=2,tp=2", "grouped", False)])
def test_expert_parallel_layer_matches_reference(mesh, routing, renormalised):
    cfg = dataclasses.replace(MOE, moe_routing=routing, capacity_factor=float(MOE.n_experts),
                              norm_topk_prob=renormalised)
    x, w = random_layer()
    m = build_mesh(mesh)

    def parallel(x, w):
        return moe_ffn(x, w, cfg, mesh=m, rules=DEFAULT_RULES)

    def objective(fn, x, w):
        y = fn(x, w)
        return jnp.sum(y * jnp.cos(y))  # any non-trivial scalar of the output

    y, sums = jax.jit(parallel)(x, w)
    y_ref = reference_moe(x.reshape(-1, x.shape[-1]), w, cfg).reshape(x.shape)
    assert rel(y, y_ref) <= 1e-5
    assert float(sums["dropped"]) == 0 and float(sums["tokens"]) == x.shape[0] * x.shape[1]
    g = jax.jit(jax.grad(lambda x, w: objective(lambda *a: parallel(*a)[0], x, w),
                         argnums=(0, 1)))(x, w)
    g_ref = jax.grad(lambda x, w: objective(
        lambda x, w: reference_moe(x.reshape(-1, x.shape[-1]), w, cfg).reshape(x.shape), x, w),
        argnums=(0, 1))(x, w)
    assert rel(g[0], g_ref[0]) <= 1e-5
    for k in w:
        assert rel(g[1][k], g_ref[1][k]) <= 1e-5, k


def test_grouped_layout_gives_each_block_one_expert():
    """Every assignment gets its own row, in a block of its expert, within the static block
    count, also when routing is as skewed as it can be (all to one expert) or one-sided."""
    n_experts, n = 16, 1024
    skews = {"random": jax.random.randint(jax.random.key(0), (n,), 0, n_experts),
             "one expert": jnp.full((n,), 3), "two experts": jnp.arange(n) % 2 * 15}
    for name, experts in skews.items():
        shape = grouped.blocks_for(n, n_experts, 1)
        lay = grouped.layout(experts.astype(jnp.int32), n_experts, shape)
        rows, owner = np.asarray(lay.rows), np.asarray(lay.block_expert)
        assert len(set(rows.tolist())) == n, name
        assert (owner[rows // shape.block] == np.asarray(experts)).all(), name
        loops = shape.n_blocks // shape.chunk  # chunks round the bound up by < one block each
        assert shape.n_blocks * shape.block <= n + (n_experts + loops) * shape.block, name


def test_grouped_experts_run_the_routed_flops():
    """The compiled layer's matmuls (forward and backward, loops counted by their trips)
    against the routed FLOPs: the padded dropless path runs E/k times them."""
    t, n_experts, k, d, f = 2048, 32, 4, 64, 32
    cfg = dataclasses.replace(MOE, d_model=d, d_ff=f, n_experts=n_experts, top_k=k)
    keys = jax.random.split(jax.random.key(0), 5)
    w = {"router": jax.random.normal(keys[0], (d, n_experts)),
         "w_gate": jax.random.normal(keys[1], (n_experts, d, f)),
         "w_up": jax.random.normal(keys[2], (n_experts, d, f)),
         "w_down": jax.random.normal(keys[3], (n_experts, f, d))}
    x = jax.random.normal(keys[4], (1, t, d))
    routed = 3 * (2 * t * k * d * f) * 3  # three projections; forward, input and weight grads
    mesh = build_mesh("dp=1", jax.devices()[:1])
    executed = {}
    for routing in ("grouped", "dropless"):
        c = dataclasses.replace(cfg, moe_routing=routing)
        step = jax.jit(jax.grad(lambda x, w, c=c: jnp.sum(local_moe(x, w, c)[0] ** 2),
                                argnums=(0, 1)))
        executed[routing] = report(step.lower(x, w).compile().as_text(), mesh).executed_flops
    router = 2 * t * d * n_experts * 3
    assert 1.0 <= (executed["grouped"] - router) / routed <= 1.25, executed
    assert (executed["dropless"] - router) / routed >= n_experts / k * 0.99, executed


def test_grouped_rounds_serve_every_token_when_routing_is_skewed():
    """Every token routed to the experts of one device: its peers each send it all their
    assignments, several rounds of the bounded buffer, and nothing is dropped."""
    cfg = dataclasses.replace(MOE, moe_routing="grouped")
    x, w = random_layer(seed=2)
    w["router"] = jnp.zeros_like(w["router"])  # ties: top-k picks experts 0 and 1, device 0
    mesh = build_mesh("ep=4", jax.devices()[:4])
    y, sums = jax.jit(lambda x, w: moe_ffn(x, w, cfg, mesh=mesh, rules=DEFAULT_RULES))(x, w)
    counts = np.asarray(sums["counts"])
    assert counts[2:].sum() == 0 and float(sums["dropped"]) == 0
    reference = lambda x, w: reference_moe(x.reshape(-1, x.shape[-1]), w, cfg).reshape(x.shape)
    assert rel(y, reference(x, w)) <= 1e-5
    # The backward reruns the later rounds: every gradient but the router's (zero here).
    objective = lambda fn: jax.grad(lambda x, w: jnp.sum(jnp.sin(fn(x, w))), argnums=(0, 1))
    g = jax.jit(objective(lambda x, w: moe_ffn(x, w, cfg, mesh=mesh, rules=DEFAULT_RULES)[0]))(
        x, w)
    g_ref = objective(reference)(x, w)
    assert rel(g[0], g_ref[0]) <= 1e-5
    for k in ("w_gate", "w_up", "w_down"):
        assert rel(g[1][k], g_ref[1][k]) <= 1e-5, k


# Grouped with ep beside fsdp: the overlapped exchanges' fsdp=2,ep=2,tp=2 case and the kernel
# case here; on ep=4 alone: the overlapped ep=4 case; on ep=8: the layer against the
# reference loop (test_expert_parallel_layer_matches_reference[ep=8-grouped-True]).
@pytest.mark.parametrize("mesh, matmul", [("dp=2,fsdp=2,tp=2", "loop"),
                                          ("fsdp=2,ep=2,tp=2", "kernel")])
def test_grouped_matches_padded_single_device(corpus, single_device, mesh, matmul):
    """Grouped on the mesh against the padded dropless path on one device; on one layout
    with its matmuls as the Pallas kernels (`--expert-matmul kernel`, interpreted here)."""
    grouped_moe = dataclasses.replace(MOE, moe_routing="grouped")
    run = train_steps(grouped_moe, mesh, corpus.train, config(expert_matmul=matmul))
    assert_matches(run, single_device(MOE))


SHARED = dataclasses.replace(MOE, shared_d_ff=32, shared_gate=True)


# DeepSeek-V3's balancing: sigmoid scores, routing biases moved by the load.
BIASED = dataclasses.replace(SHARED, gating="sigmoid", router_bias_rate=0.01)


def test_routing_bias_chooses_experts_but_does_not_weigh_them():
    x, w = random_layer(seed=2)
    x = x.reshape(-1, x.shape[-1])
    cfg = dataclasses.replace(BIASED, norm_topk_prob=False)
    bias = jnp.zeros(cfg.n_experts).at[5].set(10.0)
    weights, experts, probs, _ = route(x, w["router"], cfg, bias)
    assert np.all(np.asarray(experts)[:, 0] == 5)  # the bias dominates the choice ...
    np.testing.assert_array_equal(weights[:, 0], probs[:, 5])  # ... never the weight
    assert np.array_equal(route(x, w["router"], cfg, jnp.zeros(cfg.n_experts))[1],
                          route(x, w["router"], cfg)[1])


def test_rebalanced_bias_moves_toward_the_mean_load():
    loads = jnp.array([[6.0, 2.0, 4.0, 4.0]])  # mean 4
    np.testing.assert_array_equal(rebalanced_bias(jnp.zeros((1, 4)), loads, 0.5),
                                  [[-0.5, 0.5, 0.0, 0.0]])


def test_routing_biases_resume_onto_another_mesh(tmp_path):
    """The biases live in the checkpoint: resumed on another mesh, the steps after go on
    exactly as the uninterrupted run's (a lost bias would route differently)."""
    run = {"model": "moe-tiny", "router_bias_rate": 0.05, "batch_size": 8, "seq_len": 32,
           "steps": 4, "warmup": 2, "eval_every": 0, "checkpoint_every": 2}
    full = train(TrainConfig.of(**run, mesh="ep=4", run_dir=str(tmp_path / "a")))
    resumed = train(TrainConfig.of(**run, mesh="fsdp=2,ep=2", run_dir=str(tmp_path / "b"),
                                   resume=str(tmp_path / "a" / "checkpoints" / "2")))
    full = {r["step"]: r["loss"] for r in full}
    assert [r["step"] for r in resumed] == [3, 4]
    for r in resumed:
        assert r["loss"] == pytest.approx(full[r["step"]], rel=1e-5)


def test_low_capacity_drops_tokens_and_they_skip_the_mlp():
    cfg = dataclasses.replace(MOE, moe_routing="capacity", capacity_factor=0.25)
    x, w = random_layer(seed=1)
    mesh = build_mesh("ep=4", jax.devices()[:4])
    y, sums = jax.jit(lambda x, w: moe_ffn(x, w, cfg, mesh=mesh, rules=DEFAULT_RULES))(x, w)
    stacked = jax.tree.map(lambda s: s[None], sums)
    terms = objective.loss_terms(cfg, jnp.zeros(()), stacked)
    dropped = float(objective.report(cfg, terms)[1][objective.DROPPED_FRACTION])
    assert 0.5 < dropped < 1.0  # capacity is a quarter of the even share
    # A token whose every choice overflowed gets exactly zero: the residual passes unchanged.
    zero_rows = np.all(np.asarray(y) == 0, axis=-1)
    assert zero_rows.sum() > 0
    full = reference_moe(x.reshape(-1, x.shape[-1]), w, cfg).reshape(x.shape)
    kept = ~zero_rows & (np.abs(np.asarray(y) - np.asarray(full)).max(-1) < 1e-5)
    assert kept.sum() > 0  # tokens that kept all their experts match the full computation


# fsdp=2,ep=4 (dropless, the default routing): test_deepseek_train's and test_gpt_oss_train's
# fsdp=2,ep=4 cases, and here overlapped dropless (with routing biases) on that mesh.
@pytest.mark.parametrize("mesh", ["ep=2", "ep=4", "dp=2,ep=4", "ep=2,tp=2"])
def test_matches_single_device(corpus, single_device, mesh):
    run = train_steps(MOE, mesh, corpus.train)
    assert_matches(run, single_device(MOE))
    if mesh == "dp=2,ep=4":  # expert parallelism exchanges tokens with all-to-alls: forward
        # dispatch + return, and their transposes in the backward pass, per layer (the
        # compiled step again: the compilation cache's copy of the one just run)
        assert sum(collective_counts(b)["all-to-all"] for b in loop_bodies(run.hlo)) >= 4


@pytest.mark.parametrize("mesh, routing, remat, resent, model", [
    ("fsdp=2,ep=2,tp=2", "grouped", "full", True, MOE),
    ("fsdp=2,ep=4", "dropless", "none", False, BIASED), ("ep=4", "grouped", "full", False, MOE)],
    ids=["fsdp=2,ep=2,tp=2-grouped-full", "fsdp=2,ep=4-dropless-none-biased",
         "ep=4-grouped-full"])
def test_overlapped_exchanges_match_single_device(corpus, single_device, mesh, routing, remat,
                                                  resent, model):
    """`--moe-overlap on`: each exchange in pieces (what NVIDIA GPUs get by default) computes
    what one device computes, and the step really runs the pieces: OVERLAP_PIECES times
    the all-to-alls of the unsplit step without remat. Under `--remat full` too where the
    pieces hide the exchanges (ep alone): the policy keeps what they delivered
    (`remat.EXPERT_EXCHANGE`), so the backward sends nothing again; where fsdp splits
    grouped routing's tokens it keeps the block input alone and sends them again.
    On fsdp=2,ep=4 with DeepSeek-V3's aux-loss-free balancing and a gated shared expert
    (Qwen2-MoE's block): the routing biases (never trained: no gradient) move exactly as
    on one device (was its own test on fsdp=2,ep=4, grouped: 18 s of the suite)."""
    model = dataclasses.replace(model, moe_routing=routing)
    run = train_steps(model, mesh, corpus.train, config(moe_overlap="on", remat=remat))
    reference = single_device(dataclasses.replace(model, moe_routing=MOE.moe_routing))
    assert_matches(run, reference)
    if model.router_bias_rate:
        bias = reference.params["blocks"]["mlp"]["router_bias"]
        assert np.abs(bias).max() > 0
        np.testing.assert_array_equal(run.params["blocks"]["mlp"]["router_bias"], bias)
        assert run.grads["blocks"]["mlp"]["router_bias"] is None
        assert {"shared_mlp", "shared_gate"} <= set(run.grads["blocks"])
    plan = plan_of(mesh, model="moe-tiny", moe_routing=routing, moe_overlap="off")
    tokens = jax.ShapeDtypeStruct((16, 32), jnp.int32)  # the harness's batch
    whole = make_train_step(plan).lower(plan.abstract, {"inputs": tokens, "targets": tokens})
    sent, unsplit = expert_exchanges(run.lowered, plan.mesh), expert_exchanges(whole, plan.mesh)
    assert unsplit > 0 and (sent > OVERLAP_PIECES * unsplit if resent else
                            sent == OVERLAP_PIECES * unsplit)


def expert_exchanges(lowered, mesh) -> int:
    """All-to-alls over the `expert` axis in a lowered step (groups as positions in the mesh)."""
    ids = np.moveaxis(np.arange(mesh.devices.size).reshape(mesh.devices.shape),
                      mesh.axis_names.index("expert"), -1)
    groups = (f"replica_groups = dense<{json.dumps(ids.reshape(-1, ids.shape[-1]).tolist())}>",
              # jax 0.12 names the mesh axes instead of listing the groups
              'axes = [#stablehlo.axis_ref<name = "expert">]>')
    return sum(any(g in line for g in groups) for line in lowered.as_text().splitlines()
               if "stablehlo.all_to_all" in line)


TRAIN = ["--model", "moe-tiny", "--steps", "2", "--batch-size", "8", "--seq-len", "32"]


def test_metrics_report_balance_and_drops(tmp_path, capfd):
    # The command's `main` in this process (a new interpreter costs ~3 s importing jax).
    code = main([*TRAIN, "--mesh", "ep=4", "--moe-routing", "capacity", "--capacity-factor",
                 "0.5", "--run-dir", str(tmp_path)])
    assert code == 0, capfd.readouterr().err
    line = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])
    for key in ("moe_aux_loss", "moe_z_loss", "moe_load_imbalance", "ce_loss"):
        assert key in line
    assert line["moe_dropped_fraction"] > 0


@pytest.mark.parametrize("args, message", [
    (["--top-k", "9"], "--top-k 9 must be between 1 and --n-experts 8"),
    (["--mesh", "ep=3", "--n-experts", "8"], "experts dimension 8 is not divisible by expert=3"),
    (["--capacity-factor", "0"], "--capacity-factor 0.0 must be positive"),
    (["--router-bias-rate", "-1"], "--router-bias-rate -1.0 must be 0 (off) or positive"),
    (["--expert-matmul", "kernel"], "--expert-matmul kernel runs grouped routing's expert "
     "matmuls; add --moe-routing grouped"),
    (["--expert-matmul", "kernel", "--fp8", "rowwise"], "use --fp8 off or --expert-matmul loop"),
])
def test_bad_moe_input(train_refusal, args, message):
    assert message in train_refusal([*TRAIN, *args])

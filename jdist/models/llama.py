"""A Llama-style decoder: embedding, pre-norm blocks (GQA attention with rotary embeddings,
SwiGLU MLP), final RMSNorm, untied (or tied) output head.

Blocks are stacked along a leading `layers` dimension and run with `jax.lax.scan`, so
compile time does not grow with depth and pipeline stages can slice the stack.
Every parameter and key activation carries logical names; no mesh axis appears here.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jdist.models import remat
from jdist.models.config import ModelConfig
from jdist.models.context import LOCAL, ModelContext
from jdist.models.layers import (
    RMSNorm,
    apply_rotary,
    dot_product_attention,
    in_window,
    param,
    rotary_tables,
    weight,
    zeros,
)
from jdist.models.lora import adapted, adapter
from jdist.models.mla import LATENT_CACHE, LatentAttention
from jdist.models.moe import MoE
from jdist.models.mtp import MultiTokenPrediction, next_tokens
from jdist.models.names import MTP
from jdist.models.runs import Run, runs
from jdist.spmd.axes import (
    ACT_EMBED,
    BATCH,
    EMBED,
    HEAD_DIM,
    HEADS,
    KV_HEADS,
    KV_LENGTH,
    LAYERS,
    LENGTH,
    MLP,
    VOCAB,
)

RESIDUAL = (BATCH, LENGTH, ACT_EMBED)
# The gated MLP's activations (`ModelConfig.mlp_activation`): gelu_tanh is HF's
# gelu_pytorch_tanh (Gemma 3).
ACTIVATIONS = {"silu": jax.nn.silu, "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True)}
# Keys (or values) of every layer while decoding: [layers, batch, max_len, kv_heads, head_dim].
KV_CACHE = (LAYERS, BATCH, KV_LENGTH, KV_HEADS, HEAD_DIM)
_named = checkpoint_name


class Attention(nnx.Module):
    """Column-parallel Q/K/V (heads split), row-parallel output projection."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, window: int | None = None,
                 rope: bool = True):
        d, hd = cfg.d_model, cfg.dim_per_head
        out_std = 0.02 / (2 * cfg.n_layers) ** 0.5
        self.wq = param(rngs, (d, cfg.n_heads, hd), (EMBED, HEADS, HEAD_DIM))
        self.wk = param(rngs, (d, cfg.n_kv_heads, hd), (EMBED, KV_HEADS, HEAD_DIM))
        self.wv = param(rngs, (d, cfg.n_kv_heads, hd), (EMBED, KV_HEADS, HEAD_DIM))
        self.wo = param(rngs, (cfg.n_heads, hd, d), (HEADS, HEAD_DIM, EMBED), std=out_std)
        # Qwen3 normalises each query and key head (its own scale over head_dim) before RoPE.
        self.q_norm = RMSNorm(hd, cfg.norm_eps, cfg.norm_plus_one) if cfg.qk_norm else None
        self.k_norm = RMSNorm(hd, cfg.norm_eps, cfg.norm_plus_one) if cfg.qk_norm else None
        # Static per module, so a stack of layers with another window is another stack
        # (`models.runs`: the run's, else the config's).
        self.window = window
        # Which rotary tables of `rotary_of` this layer turns q and k by: a sliding-window
        # layer's own (Gemma 3's local rope base), else the model's.
        self.rope_half = (1 if window is not None else 0) if cfg.rope_local_theta else None
        # Kernels scale scores by head_dim**-0.5; Gemma 3's query_pre_attn_scalar**-0.5 is
        # that times this factor, applied to q so every kernel (and the cache) gets it.
        scalar = cfg.query_pre_attn_scalar
        self.q_scale = (hd / scalar) ** 0.5 if scalar and scalar != hd else None
        self.rope = rope  # NoPE layers (`models.runs.kind_of`) rotate nothing
        self.sinks = param(rngs, (cfg.n_heads,), (HEADS,)) if cfg.attention_sinks else None
        # gpt-oss's biases on q, k, v and the output (zero at start, like any bias).
        self.bq = zeros((cfg.n_heads, hd), (HEADS, HEAD_DIM)) if cfg.attention_bias else None
        self.bk = zeros((cfg.n_kv_heads, hd), (KV_HEADS, HEAD_DIM)) if cfg.attention_bias else None
        self.bv = zeros((cfg.n_kv_heads, hd), (KV_HEADS, HEAD_DIM)) if cfg.attention_bias else None
        self.bo = zeros((d,), (EMBED,)) if cfg.attention_bias else None
        # LoRA adapters (None unless cfg.lora targets them), drawn from their own rng stream
        # so the base weights are the same with and without them.
        self.q_lora = adapter(cfg.lora, "q", self.wq, 1, rngs)
        self.k_lora = adapter(cfg.lora, "k", self.wk, 1, rngs)
        self.v_lora = adapter(cfg.lora, "v", self.wv, 1, rngs)
        self.o_lora = adapter(cfg.lora, "o", self.wo, 2, rngs)

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array, ctx: ModelContext,
                 segment_ids: jax.Array | None = None, cache: tuple | None = None):
        """[batch, length, embed] -> [batch, length, embed]. With `cache` (decoding, see
        `cached_attention`), returns (output, the updated cache)."""
        c = ctx.constrain
        q_names, kv_names = (BATCH, LENGTH, HEADS, HEAD_DIM), (BATCH, LENGTH, KV_HEADS, HEAD_DIM)
        q, k, v = ctx.widen(x, tuple(weight(w, x) for w in (self.wq, self.wk, self.wv)),
                            "bse,ehd->bshd", (q_names, kv_names, kv_names))
        q = c(_named(adapted(x, q, self.q_lora), remat.QUERY), q_names)
        k = c(_named(adapted(x, k, self.k_lora), remat.KEY), kv_names)
        v = c(_named(adapted(x, v, self.v_lora), remat.VALUE), kv_names)
        if self.bq is not None:
            q, k, v = (t + weight(b, t) for t, b in ((q, self.bq), (k, self.bk), (v, self.bv)))
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rope_half is not None:
            cos, sin = (jnp.split(t, 2, axis=-1)[self.rope_half] for t in (cos, sin))
        if self.rope:
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if self.q_scale is not None:
            q = q * jnp.asarray(self.q_scale, q.dtype)
        if cache is not None:
            return self.cached_attention(q, k, v, cache, ctx)
        attend = ctx.attention or dot_product_attention
        out = attend(q, k, v, True, **self.options(q, segment_ids=segment_ids))
        out = c(out, (BATCH, LENGTH, HEADS, HEAD_DIM))
        return _named(self.output(out, ctx), remat.ATTENTION_OUT)

    def options(self, like: jax.Array, **given) -> dict:
        """The keyword arguments of the attention call that are set: packed documents'
        `segment_ids`, the sliding `window`, the `sinks` in the compute dtype."""
        sinks = None if self.sinks is None else weight(self.sinks, like)
        given |= {"window": self.window, "sinks": sinks}
        return {name: value for name, value in given.items() if value is not None}

    def output(self, out: jax.Array, ctx: ModelContext) -> jax.Array:
        """The output projection [batch, length, heads, head_dim] -> [batch, length, embed]."""
        out = adapted(out, ctx.narrow(out, weight(self.wo, out), "bshd,hde->bse",
                                     (BATCH, LENGTH, HEADS, HEAD_DIM)), self.o_lora)
        return out if self.bo is None else out + weight(self.bo, out)

    def cached_attention(self, q, k, v, cache: tuple, ctx: ModelContext):
        """Decoding. `cache` = (keys and values of every layer (`KV_CACHE`), this layer's
        index in them, the slot this call's first token goes to (int32 scalars), the slots
        each query may see [batch, length, max_len]). Returns (output, (keys, values) with
        this call's written): the stacks are updated in place, never copied whole."""
        keys, values, layer, index, visible = cache
        at = (layer, 0, index, 0, 0)
        keys = jax.lax.dynamic_update_slice(keys, k.astype(keys.dtype)[None], at)
        values = jax.lax.dynamic_update_slice(values, v.astype(values.dtype)[None], at)
        if self.window is not None:  # slots and positions differ by each row's padding alone
            slots = index + jnp.arange(q.shape[1])
            visible = visible & in_window(slots, jnp.arange(keys.shape[2]), self.window)
        sinks = self.options(q.astype(keys.dtype)).get("sinks")
        out = dot_product_attention(q.astype(keys.dtype), keys[layer], values[layer], False,
                                    visible=visible, sinks=sinks)
        out = ctx.constrain(out, (BATCH, LENGTH, HEADS, HEAD_DIM))
        return self.output(out, ctx), (keys, values)


class SwiGLU(nnx.Module):
    """Column-parallel gate/up, row-parallel down projection."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, d_ff: int | None = None):
        out_std = 0.02 / (2 * cfg.n_layers) ** 0.5
        d_ff = d_ff or cfg.d_ff
        self.w_gate = param(rngs, (cfg.d_model, d_ff), (EMBED, MLP))
        self.w_up = param(rngs, (cfg.d_model, d_ff), (EMBED, MLP))
        self.w_down = param(rngs, (d_ff, cfg.d_model), (MLP, EMBED), std=out_std)
        self.gate_lora = adapter(cfg.lora, "gate", self.w_gate, 1, rngs)
        self.up_lora = adapter(cfg.lora, "up", self.w_up, 1, rngs)
        self.down_lora = adapter(cfg.lora, "down", self.w_down, 1, rngs)
        self.activation = cfg.mlp_activation

    def __call__(self, x: jax.Array, ctx: ModelContext) -> jax.Array:
        names = (BATCH, LENGTH, MLP)
        gate, up = ctx.widen(x, (weight(self.w_gate, x), weight(self.w_up, x)), "bse,ef->bsf",
                             (names, names))
        gate = _named(adapted(x, gate, self.gate_lora), remat.MLP_GATE)
        up = _named(adapted(x, up, self.up_lora), remat.MLP_UP)
        hidden = ctx.constrain(ACTIVATIONS[self.activation](gate) * up, names)
        down = ctx.narrow(hidden, weight(self.w_down, hidden), "bsf,fe->bse", names)
        return _named(adapted(hidden, down, self.down_lora), remat.MLP_DOWN)


class Block(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, run: Run | None = None,
                 kind: tuple | None = None):
        run = run or runs(cfg)[0]
        # (window, rope) of this block (`models.runs.kind_of`), or the config's.
        window, rope = kind or (cfg.sliding_window, True)
        norm = lambda: RMSNorm(cfg.d_model, cfg.norm_eps, cfg.norm_plus_one)
        self.attn_norm = norm()
        self.attn = LatentAttention(cfg, rngs) if cfg.kv_lora_rank else \
            Attention(cfg, rngs, window, rope)
        self.mlp_norm = norm()
        # Gemma 3 also normalises the attention's and the MLP's outputs (`sandwich_norms`).
        self.attn_out_norm = norm() if cfg.sandwich_norms else None
        self.mlp_out_norm = norm() if cfg.sandwich_norms else None
        self.mlp = MoE(cfg, rngs) if run.moe else SwiGLU(cfg, rngs, run.d_ff)
        # A shared expert beside the routed ones, for every token.
        shared = run.moe and cfg.shared_d_ff
        self.shared_mlp = SwiGLU(cfg, rngs, cfg.shared_d_ff) if shared else None
        self.shared_gate = param(rngs, (cfg.d_model, 1), (EMBED, None)) \
            if shared and cfg.shared_gate else None

    def feed_forward(self, x: jax.Array, ctx: ModelContext) -> tuple[jax.Array, dict]:
        """The MLP (or the routed experts, plus any shared expert) of the normed `x`
        (then normed again with `sandwich_norms`) and the MoE balance statistics ({} if
        dense)."""
        x = self.mlp_norm(x)
        out = self.mlp(x, ctx)
        out, stats = out if isinstance(out, tuple) else (out, {})
        if self.shared_mlp is not None:
            shared = self.shared_mlp(x, ctx)
            if self.shared_gate is not None:
                shared = shared * jax.nn.sigmoid(x @ weight(self.shared_gate, x))
            out = out + shared
        return _normed(self.mlp_out_norm, out), stats

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array, ctx: ModelContext,
                 segment_ids: jax.Array | None = None) -> tuple[jax.Array, dict]:
        """Returns the new residual stream and the MoE balance statistics ({} if dense)."""
        h = self.attn(self.attn_norm(x), cos, sin, ctx, segment_ids)
        x = ctx.constrain(x + _normed(self.attn_out_norm, h), RESIDUAL)
        out, stats = self.feed_forward(x, ctx)
        return ctx.constrain(x + out, RESIDUAL), stats

    def decode(self, x: jax.Array, cos: jax.Array, sin: jax.Array, ctx: ModelContext,
               cache: tuple) -> tuple[jax.Array, tuple]:
        """The block over a KV cache (`Attention.cached_attention`): returns the new residual
        stream and the updated cache. MoE balance statistics are dropped."""
        h, kv = self.attn(self.attn_norm(x), cos, sin, ctx, cache=cache)
        x = ctx.constrain(x + _normed(self.attn_out_norm, h), RESIDUAL)
        out, _ = self.feed_forward(x, ctx)
        return ctx.constrain(x + out, RESIDUAL), kv


def _normed(norm: RMSNorm | None, x: jax.Array) -> jax.Array:
    return x if norm is None else norm(x)


class Period(nnx.Module):
    """One period of a repeating attention pattern (`models.runs`): its blocks, one after
    another, as one row of a run's stack (`layer_0`, `layer_1`, ... in model order)."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, run: Run):
        self.period = run.period
        for j, kind in enumerate(run.kinds):
            setattr(self, f"layer_{j}", Block(cfg, rngs, run, kind))

    def blocks(self) -> list[Block]:
        return [getattr(self, f"layer_{j}") for j in range(self.period)]

    def __call__(self, x, cos, sin, ctx, segment_ids=None) -> tuple[jax.Array, dict]:
        """The blocks in turn -> (x, their MoE statistics stacked [period, ...])."""
        stats = []
        for block in self.blocks():
            x, s = block(x, cos, sin, ctx, segment_ids)
            stats.append(s)
        return x, jax.tree.map(lambda *s: jnp.stack(s), *stats) if stats[0] else {}

    def decode(self, x, cos, sin, ctx, cache: tuple) -> tuple[jax.Array, tuple]:
        """`Block.decode` of each block, at its layer of the cache."""
        keys, values, layer, index, visible = cache
        for j, block in enumerate(self.blocks()):
            x, (keys, values) = block.decode(x, cos, sin, ctx,
                                             (keys, values, layer + j, index, visible))
        return x, (keys, values)


def stacked_blocks(cfg: ModelConfig, rngs: nnx.Rngs, run: Run | None = None) -> Block:
    """A run's blocks (default: the first run, all `n_layers` of a homogeneous model) as
    one Block whose parameters have a leading `layers` dimension; a periodic run's as one
    `Period` a row."""
    run = run or runs(cfg)[0]

    @nnx.split_rngs(splits=run.rows)
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: LAYERS})
    def make(rngs: nnx.Rngs) -> Block | Period:
        if run.period > 1:
            return Period(cfg, rngs, run)
        return Block(cfg, rngs, run, run.kinds[0] if run.kinds else None)

    return make(rngs)


def rotary_of(cfg: ModelConfig, positions) -> tuple[jax.Array, jax.Array]:
    """The model's rotary tables (`rotary_tables`) of `positions`. With a local rope base
    (`rope_local_theta`, Gemma 3), the global tables then the local ones along the last axis:
    one pair of arrays, so stages and loops pass them as before, and each layer takes its
    half (`Attention.rope_half`)."""
    tables = rotary_tables(positions, cfg.rope_dim, cfg.rope_theta, cfg.rope_scaling)
    if not cfg.rope_local_theta:
        return tables
    local = rotary_tables(positions, cfg.rope_dim, cfg.rope_local_theta)
    return tuple(jnp.concatenate(pair, axis=-1) for pair in zip(tables, local))


def _concatenated(stats: list[dict]) -> dict:
    """The runs' per-layer statistics as one stack: runs without experts have none."""
    stats = [s for s in stats if s]
    if len(stats) < 2:
        return stats[0] if stats else {}
    return jax.tree.map(lambda *s: jnp.concatenate(s), *stats)


class Llama(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.config = cfg
        self.embed = param(rngs, (cfg.vocab_size, cfg.d_model), (VOCAB, EMBED))
        for run in runs(cfg):  # `blocks`, then `blocks_1`, ... (models.runs)
            setattr(self, run.key, stacked_blocks(cfg, rngs, run))
        self.final_norm = RMSNorm(cfg.d_model, cfg.norm_eps, cfg.norm_plus_one)
        if cfg.mtp_depth:  # one dense block of its own (models.mtp)
            dense = Run(MTP, cfg.n_layers, 1, False, cfg.dense_d_ff or cfg.d_ff)
            self.mtp = MultiTokenPrediction(cfg, rngs, Block(cfg, rngs, dense))
        if not cfg.tie_embeddings:
            self.head = param(rngs, (cfg.d_model, cfg.vocab_size), (EMBED, VOCAB))

    def __call__(self, tokens: jax.Array, ctx: ModelContext = LOCAL, *,
                 positions: jax.Array | None = None, segment_ids: jax.Array | None = None,
                 with_aux: bool = False):
        """tokens [batch, length] int32 -> logits [batch, length, vocab].

        `ctx` is what the step provides (activation constraints, attention and expert
        kernels, per-layer parameter handling; see `models.context`). `positions` [length]
        are the tokens' positions in the text (default 0..length-1); a step that stores
        tokens out of order (causal load balancing) passes them, and packed documents pass
        [batch, length] positions restarting at each document, with `segment_ids` [batch,
        length] (document index of each token: attention stays inside a document). With
        `with_aux`, returns (logits, MoE balance statistics of every layer)."""
        x, stats = self.run_blocks(self.embed_tokens(tokens, ctx), ctx, positions, segment_ids)
        logits = self.logits(x, ctx)
        if with_aux:
            return logits, stats  # each statistic stacked over layers
        return logits

    # The three pieces of __call__, also run separately by pipeline stages
    # (jdist.parallel.pipeline), so a stage computes exactly what the whole model does.

    def embed_tokens(self, tokens: jax.Array, ctx: ModelContext = LOCAL) -> jax.Array:
        """tokens [batch, length] -> residual stream [batch, length, embed], in the compute
        dtype. Rows are taken from the float32 table, so the gradient's scatter-add
        accumulates in float32."""
        if ctx.embed_lookup is not None:  # the step's, on the table it keeps sharded
            rows = ctx.embed_lookup(tokens)
        else:
            # Gathering rows of a vocab/fsdp-sharded table makes GSPMD replicate it clumsily
            # ("involuntary full rematerialization"); all-gather it explicitly instead.
            table = ctx.constrain(self.embed[...], (None, ACT_EMBED))
            rows = jnp.take(table, tokens, axis=0).astype(ctx.compute_dtype)
        if self.config.embed_scale:  # Gemma: times sqrt(d_model), in the rows' dtype as HF
            rows = rows * jnp.asarray(self.config.d_model ** 0.5, rows.dtype)
        return ctx.constrain(rows, RESIDUAL)

    def run_blocks(self, x: jax.Array, ctx: ModelContext = LOCAL,
                   positions: jax.Array | None = None, segment_ids: jax.Array | None = None):
        """The stacked blocks (however many each run's stack holds) -> (x, stats per layer
        with experts). Each run is one loop, the context's (`ctx.layer_loop`): the step's
        gathers each layer's parameters and checkpoints its activations."""
        cos, sin = self.rotary(x.shape[1], positions)
        # What differs per row of the batch goes to the loop beside x, which may run the
        # layer on groups of rows (`ModelContext.layer_loop`).
        rows = {"segment_ids": segment_ids}
        if cos.ndim == 3:  # per-row positions (packed documents)
            rows |= {"cos": cos, "sin": sin}
        stats = []
        for run in runs(self.config):
            graphdef, layers = nnx.split(getattr(self, run.key))
            if not jax.tree.leaves(layers)[0].shape[0]:
                continue  # a pipeline chunk that holds none of this run's blocks

            def layer(x, state, rows, graphdef=graphdef):
                return nnx.merge(graphdef, state)(x, rows.get("cos", cos),
                                                  rows.get("sin", sin), ctx, rows["segment_ids"])

            x, run_stats = ctx.layer_loop(layer, x, layers, rows, run.key)
            # A periodic run's [rows, period, ...]: its layers in model order.
            stats.append(jax.tree.map(lambda s: s.reshape(-1, *s.shape[2:]), run_stats)
                         if run.period > 1 else run_stats)
        return x, _concatenated(stats)

    def rotary(self, length: int, positions=None) -> tuple[jax.Array, jax.Array]:
        """The rotary tables of `positions` (default 0..length-1). Concrete positions are
        computed on the host in float64 (models.layers)."""
        positions = np.arange(length) if positions is None else positions
        return rotary_of(self.config, positions)

    def predict_after_next(self, y: jax.Array, tokens: jax.Array, ctx: ModelContext = LOCAL,
                           positions=None, segment_ids=None) -> jax.Array:
        """The MTP module's output [batch, length, embed] (`models.mtp`; before its norm,
        which `output_head` takes as `norm`) from the last block's `y` and the `tokens`
        the model read: at each position, for the token after next."""
        cos, sin = self.rotary(y.shape[1], positions)
        embedded = self.embed_tokens(next_tokens(tokens), ctx)
        return self.mtp(y, embedded, cos, sin, ctx, segment_ids)

    def decode(self, tokens: jax.Array, kv: tuple[jax.Array, jax.Array], index: jax.Array,
               positions: jax.Array, visible: jax.Array, ctx: ModelContext = LOCAL):
        """Decoding with a KV cache (`jdist.generate`): tokens [batch, length] (a prompt's
        prefill, or one new token per row) go to cache slots index..index+length-1 of `kv` =
        (keys, values), each [layers, batch, max_len, kv_heads, head_dim] (`KV_CACHE`; with
        MLA, latents and rope keys, `models.mla.cache_parts`).
        `positions` [batch, length] are their positions in their own text; `visible` [batch,
        length, max_len] the slots each may attend to. Returns (logits [batch, length, vocab],
        kv updated). For inference: no pipeline stages, per-layer hooks or remat."""
        cfg = self.config
        # Host float64 tables of every slot, then rows by position: the values the training
        # forward computes for the same positions.
        cos, sin = rotary_of(cfg, np.arange(kv[0].shape[2]))
        names = LATENT_CACHE if cfg.kv_lora_rank else KV_CACHE
        cos, sin = jnp.take(cos, positions, axis=0), jnp.take(sin, positions, axis=0)
        carry = (self.embed_tokens(tokens, ctx), *kv, jnp.int32(0))
        for run in runs(cfg):  # one cache of every layer; i counts the model's layers
            graphdef, layers = nnx.split(getattr(self, run.key))

            def layer(carry, layer_state, graphdef=graphdef, period=run.period):
                x, keys, values, i = carry  # the whole stack is carried: written in place
                block = nnx.merge(graphdef, layer_state)
                x, (keys, values) = block.decode(x, cos, sin, ctx,
                                                 (keys, values, i, index, visible))
                return (ctx.constrain(x, RESIDUAL), ctx.constrain(keys, names),
                        ctx.constrain(values, names), i + period), None

            carry, _ = jax.lax.scan(layer, carry, layers)
        x, keys, values, _ = carry
        return self.logits(x, ctx), (keys, values)

    def output_head(self, x: jax.Array, norm=None) -> tuple[jax.Array, nnx.Param, int]:
        """What the logits are made of: (final-normed hidden states [batch, length, embed],
        the output weight parameter, its vocab dimension: 1 for the head [embed, vocab], 0
        for a tied table [vocab, embed]). A step's loss takes these, so that it need not
        hold [batch, length, vocab] logits (`jdist.parallel.vocab`). `norm`: another final
        norm than the model's (the MTP module's)."""
        h = (norm or self.final_norm)(x)
        if self.config.tie_embeddings:
            return h, self.embed, 0
        return h, self.head, 1

    def logits(self, x: jax.Array, ctx: ModelContext = LOCAL, norm=None) -> jax.Array:
        """Final norm and output head: [batch, length, embed] -> [batch, length, vocab]."""
        h, p, vocab_dim = self.output_head(x, norm)
        logits = jnp.einsum("bse,ev->bsv" if vocab_dim else "bse,ve->bsv", h, weight(p, h))
        return ctx.constrain(logits, (BATCH, LENGTH, VOCAB))

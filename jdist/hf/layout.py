"""Where each jdist parameter lives in a Hugging Face checkpoint (Llama, Qwen3, Mixtral,
Qwen3-MoE: `tensors`), and how its layout differs: HF stores `Linear.weight` as [out, in]
with heads flattened into rows or columns, and each expert's weights as its own tensor;
jdist keeps [in, out] with heads (and experts) as their own dimension. Both use
rotate-half rotary embeddings, so q/k need no permutation, and query head h uses kv head
h // group in both.

Every conversion works on a *slice*: `read` maps a jdist index (the block one device holds)
to the HF rows and columns it needs, so a sharded parameter is read piece by piece."""

from __future__ import annotations

import numpy as np

from jdist.models.runs import runs

SAME, TRANSPOSE, HEADS_IN, HEADS_OUT = "same", "transpose", "heads_in", "heads_out"
# (kind, ROPE, n): as `kind`, with the last n entries of the output dimension (DeepSeek's
# rope dims) interleaved pairs in HF and halves in jdist (`deinterleave`).
ROPE = "rope"
# A stack of experts' Linear weights: jdist [experts, in, out] <- one HF tensor [out, in] per
# expert (its name formatted with `e`).
EXPERTS = "experts"
# gpt-oss's fused gate_up: jdist's gate (EVEN) and up (ODD) are the even and odd entries of
# one HF tensor's last dimension; the export writes them as one (`pair`).
EVEN, ODD = "even", "odd"
# A bias per head: jdist [heads, head_dim] <- HF [heads * head_dim].
FLAT = "flat"
LAYER = "model.layers.{i}."

# jdist parameter path -> (HF tensor name, layout). Names under `blocks` are per layer.
# Every model has these; `tensors` adds what its config says.
_COMMON: dict[tuple[str, ...], tuple[str, str]] = {
    ("embed",): ("model.embed_tokens.weight", SAME),
    ("head",): ("lm_head.weight", TRANSPOSE),
    ("final_norm", "scale"): ("model.norm.weight", SAME),
    ("blocks", "attn_norm", "scale"): (LAYER + "input_layernorm.weight", SAME),
    ("blocks", "mlp_norm", "scale"): (LAYER + "post_attention_layernorm.weight", SAME),
    ("blocks", "attn", "wq"): (LAYER + "self_attn.q_proj.weight", HEADS_IN),
    ("blocks", "attn", "wk"): (LAYER + "self_attn.k_proj.weight", HEADS_IN),
    ("blocks", "attn", "wv"): (LAYER + "self_attn.v_proj.weight", HEADS_IN),
    ("blocks", "attn", "wo"): (LAYER + "self_attn.o_proj.weight", HEADS_OUT),
}
_QK_NORMS = {  # Qwen3, Qwen3-MoE
    ("blocks", "attn", "q_norm", "scale"): (LAYER + "self_attn.q_norm.weight", SAME),
    ("blocks", "attn", "k_norm", "scale"): (LAYER + "self_attn.k_norm.weight", SAME),
}
_MLP = {
    ("blocks", "mlp", "w_gate"): (LAYER + "mlp.gate_proj.weight", TRANSPOSE),
    ("blocks", "mlp", "w_up"): (LAYER + "mlp.up_proj.weight", TRANSPOSE),
    ("blocks", "mlp", "w_down"): (LAYER + "mlp.down_proj.weight", TRANSPOSE),
}


def _experts(module: str, gate: str, up: str, down: str) -> dict:
    experts = LAYER + module + ".experts.{e}."
    return {("blocks", "mlp", "router"): (LAYER + module + ".gate.weight", TRANSPOSE),
            ("blocks", "mlp", "w_gate"): (experts + gate + ".weight", EXPERTS),
            ("blocks", "mlp", "w_up"): (experts + up + ".weight", EXPERTS),
            ("blocks", "mlp", "w_down"): (experts + down + ".weight", EXPERTS)}



def _deepseek_v3_attention(cfg) -> dict:
    """DeepseekV3's MLA. The rope dims of q_b_proj's heads and of kv_a_proj_with_mqa's rope
    key are interleaved pairs in HF (`rope_interleave`), rotate-half halves here (`ROPE`)."""
    attn = LAYER + "self_attn."
    rope = (ROPE, cfg.rope_dim)
    table = {
        ("blocks", "attn", "wkv_a"): (attn + "kv_a_proj_with_mqa.weight", (TRANSPOSE, *rope)),
        ("blocks", "attn", "kv_norm", "scale"): (attn + "kv_a_layernorm.weight", SAME),
        ("blocks", "attn", "wkv_b"): (attn + "kv_b_proj.weight", HEADS_IN),
        ("blocks", "attn", "wo"): (attn + "o_proj.weight", HEADS_OUT),
    }
    if cfg.q_lora_rank:
        table |= {("blocks", "attn", "wq_a"): (attn + "q_a_proj.weight", TRANSPOSE),
                  ("blocks", "attn", "q_norm", "scale"): (attn + "q_a_layernorm.weight", SAME),
                  ("blocks", "attn", "wq_b"): (attn + "q_b_proj.weight", (HEADS_IN, *rope))}
    else:
        table[("blocks", "attn", "wq")] = (attn + "q_proj.weight", (HEADS_IN, *rope))
    return table




def _gpt_oss(cfg) -> dict:
    """GptOss's block: attention with biases and sinks; experts stored whole (as jdist's
    [experts, in, out]), gate and up interleaved in one tensor, with biases."""
    attn, moe = LAYER + "self_attn.", LAYER + "mlp."
    table = {k: v for k, v in _COMMON.items() if k[0] == "blocks"} | {
        ("blocks", "attn", "sinks"): (attn + "sinks", SAME),
        ("blocks", "mlp", "router"): (moe + "router.weight", TRANSPOSE),
        ("blocks", "mlp", "router_b"): (moe + "router.bias", SAME),
        ("blocks", "mlp", "w_gate"): (moe + "experts.gate_up_proj", EVEN),
        ("blocks", "mlp", "w_up"): (moe + "experts.gate_up_proj", ODD),
        ("blocks", "mlp", "b_gate"): (moe + "experts.gate_up_proj_bias", EVEN),
        ("blocks", "mlp", "b_up"): (moe + "experts.gate_up_proj_bias", ODD),
        ("blocks", "mlp", "w_down"): (moe + "experts.down_proj", SAME),
        ("blocks", "mlp", "b_down"): (moe + "experts.down_proj_bias", SAME),
    }
    if cfg.attention_bias:
        table |= {("blocks", "attn", f"b{p}"): (attn + f"{p}_proj.bias", FLAT) for p in "qkv"}
        table[("blocks", "attn", "bo")] = (attn + "o_proj.bias", SAME)
    return table


def pair(table: dict, path: tuple[str, ...]) -> tuple[str, ...] | None:
    """The ODD partner of an EVEN path (same HF tensor), else None."""
    name, kind = table[path]
    if kind != EVEN:
        return None
    return next(p for p, (n, k) in table.items()
                if n == name and k == ODD and p[:-1] == path[:-1])


def interleave_pair(even: np.ndarray, odd: np.ndarray) -> np.ndarray:
    return np.stack([even, odd], axis=-1).reshape(*even.shape[:-1], 2 * even.shape[-1])


LLAMA = _COMMON | _MLP  # a dense Llama's (PEFT adapters name their modules from it)
_MIXTRAL = _experts("block_sparse_moe", "w1", "w3", "w2")
_QWEN3_MOE = _experts("mlp", "gate_proj", "up_proj", "down_proj")
# DeepseekV3's experts (named as Qwen3-MoE's), sigmoid router's correction bias, shared expert.
_DEEPSEEK_V3_MOE = _QWEN3_MOE | {
    ("blocks", "mlp", "router_bias"): (LAYER + "mlp.gate.e_score_correction_bias", SAME),
} | {("blocks", "shared_mlp", w): (LAYER + f"mlp.shared_experts.{hf}.weight", TRANSPOSE)
     for w, hf in (("w_gate", "gate_proj"), ("w_up", "up_proj"), ("w_down", "down_proj"))}


# Gemma 3's blocks: four norms (HF's post_attention_layernorm is the attention output's,
# not the MLP input's as in Llama), q/k norms, a dense MLP.
_GEMMA3 = {k: v for k, v in (_COMMON | _QK_NORMS | _MLP).items() if k[0] == "blocks"} | {
    ("blocks", "attn_out_norm", "scale"): (LAYER + "post_attention_layernorm.weight", SAME),
    ("blocks", "mlp_norm", "scale"): (LAYER + "pre_feedforward_layernorm.weight", SAME),
    ("blocks", "mlp_out_norm", "scale"): (LAYER + "post_feedforward_layernorm.weight", SAME),
}


def _per_run(cfg, table: dict, blocks: dict) -> dict:
    """`table`'s model-wide entries, then `blocks`' entries for each run's stack; a periodic
    run's under each position of its period (`layer_j`, `models.llama.Period`)."""
    table = {k: v for k, v in table.items() if k[0] != "blocks"}
    for run in runs(cfg):
        within = [(f"layer_{j}",) for j in range(run.period)] if run.period > 1 else [()]
        table |= {(run.key, *j, *k[1:]): v for j in within for k, v in blocks.items()}
    return table


def numbering(cfg, path: tuple[str, ...]) -> tuple[int, int]:
    """(the HF layer index of a block stack's first row, the step between rows) for the
    stacked parameter at `path`: a periodic run's j-th block of each row is every
    `period`-th layer from its first + j."""
    run = next(r for r in runs(cfg) if r.key == path[0])
    j = int(path[1][len("layer_"):]) if run.period > 1 else 0
    return run.first + j, run.period


def tensors(cfg) -> dict[tuple[str, ...], tuple[str, str]]:
    """The HF tensor name and layout of each parameter of `cfg` (a `ModelConfig`), in the
    order an export writes them. Its HF family follows from the config: experts with q/k
    norms are Qwen3-MoE, experts without Mixtral; q/k norms alone Qwen3, else Llama."""
    table = dict(_COMMON)
    if cfg.tie_embeddings:
        del table[("head",)]
    if cfg.kv_lora_rank:  # DeepSeek-V3: dense first blocks (a run of their own), then MoE
        table = {k: v for k, v in table.items() if k[:2] != ("blocks", "attn")}
        table |= _deepseek_v3_attention(cfg)
        per_run = {k: v for k, v in table.items() if k[0] == "blocks"}
        table = {k: v for k, v in table.items() if k[0] != "blocks"}
        for run in runs(cfg):
            blocks = per_run | (_DEEPSEEK_V3_MOE if run.moe else _MLP)
            table |= {(run.key, *k[1:]): v for k, v in blocks.items()}
        return table
    if cfg.sandwich_norms:
        return _per_run(cfg, table, _GEMMA3)
    if cfg.moe_biases:  # gpt-oss
        return _per_run(cfg, table, _gpt_oss(cfg))
    if cfg.qk_norm:
        table |= _QK_NORMS
    if cfg.n_experts:
        return table | (_QWEN3_MOE if cfg.qk_norm else _MIXTRAL)
    return table | _MLP


def hf_name(table: dict, path: tuple[str, ...], layer: int | None = None,
            expert: int | None = None) -> str:
    name, _ = table[path]
    return name.format(i=layer, e=expert) if layer is not None else name


def deinterleave(x: np.ndarray, n: int) -> np.ndarray:
    """The last n entries of x's last axis from pairs (a0, b0, a1, b1, ..) to halves."""
    tail = x[..., -n:]
    return np.concatenate([x[..., :-n], tail[..., 0::2], tail[..., 1::2]], axis=-1)


def interleave(x: np.ndarray, n: int) -> np.ndarray:
    """`deinterleave`'s inverse."""
    tail = x[..., -n:]
    pairs = np.stack([tail[..., :n // 2], tail[..., n // 2:]], axis=-1).reshape(tail.shape)
    return np.concatenate([x[..., :-n], pairs], axis=-1)


def hf_shape(kind: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The HF shape of a (per-layer) jdist shape."""
    if isinstance(kind, tuple):
        return hf_shape(kind[0], shape)
    if kind == SAME:
        return shape
    if kind in (EVEN, ODD):
        return (*shape[:-1], 2 * shape[-1])
    if kind == FLAT:
        return (shape[0] * shape[1],)
    if kind == TRANSPOSE:
        return shape[::-1]
    if kind == HEADS_IN:  # [embed, heads, head_dim] <- [heads * head_dim, embed]
        return (shape[1] * shape[2], shape[0])
    if kind == EXPERTS:  # each expert's: [experts, in, out] <- [out, in] per expert
        return (shape[2], shape[1])
    return (shape[2], shape[0] * shape[1])  # HEADS_OUT: [heads, head_dim, embed]


def read(get, kind: str, shape: tuple[int, ...], index: tuple[slice, ...]) -> np.ndarray:
    """The block `index` (slices of the per-layer jdist `shape`) of one tensor, in jdist's
    layout; `get(slices)` reads slices of the HF tensor (for EXPERTS, of the experts' HF
    tensors stacked: [experts, out, in])."""
    if isinstance(kind, tuple):  # rope dims reordered: the whole output dimension read
        base, _, n = kind
        return deinterleave(read(get, base, shape, (*index[:-1], slice(None))), n)[..., index[-1]]
    r = [range(*s.indices(n)) for s, n in zip(index, shape)]
    span = lambda x: slice(x.start, x.stop)
    if kind == SAME:
        return get(tuple(span(x) for x in r))
    if kind in (EVEN, ODD):
        last = slice(2 * r[-1].start, 2 * r[-1].stop)
        return get((*(span(x) for x in r[:-1]), last))[..., kind == ODD::2]
    if kind == FLAT:
        h, e = r
        rows = get((slice(h.start * shape[1], h.stop * shape[1]),))
        return rows.reshape(len(h), shape[1])[:, span(e)]
    if kind == TRANSPOSE:
        return get((span(r[1]), span(r[0]))).T
    if kind == EXPERTS:
        e, a, b = r
        return get((span(e), span(b), span(a))).transpose(0, 2, 1)
    if kind == HEADS_IN:
        d, h, e = r
        hd = shape[2]
        rows = get((slice(h.start * hd, h.stop * hd), span(d)))
        return rows.reshape(len(h), hd, len(d))[:, span(e)].transpose(2, 0, 1)
    d, h, e = r[2], r[0], r[1]  # HEADS_OUT
    hd = shape[1]
    cols = get((span(d), slice(h.start * hd, h.stop * hd)))
    return cols.reshape(len(d), len(h), hd)[:, :, span(e)].transpose(1, 2, 0)


def write(kind: str, x: np.ndarray) -> np.ndarray:
    """A whole per-layer jdist array in HF's layout (the inverse of `read`; for EXPERTS the
    experts' HF tensors stacked)."""
    if isinstance(kind, tuple):
        return write(kind[0], interleave(x, kind[2]))
    if kind == EXPERTS:
        return np.ascontiguousarray(x.transpose(0, 2, 1))
    if kind in (SAME, EVEN):  # EVEN: handed the pair already interleaved (`pair`)
        return x
    if kind == FLAT:
        return np.ascontiguousarray(x.reshape(-1))
    if kind == TRANSPOSE:
        return np.ascontiguousarray(x.T)
    if kind == HEADS_IN:
        return np.ascontiguousarray(x.reshape(x.shape[0], -1).T)
    return np.ascontiguousarray(x.reshape(-1, x.shape[2]).T)  # HEADS_OUT

"""Model FLOPs and utilisation: what a step's tokens/s means in hardware terms.

Training FLOPs per token are 6 x the parameters each token multiplies (forward 2, backward
4; for MoE only the top-k experts it is routed to; the output head included, the embedding
lookup not) plus the attention scores and context, 12 x layers x heads x head_dim x length
(6 x (head_dim + v_head_dim) under MLA; full, not halved for causality: PaLM's convention,
so numbers compare with MaxText and torchtitan; a sliding window's layers count the window
instead of the length). Recomputation (--remat, pipeline
recompute) is not counted: it is overhead, so it lowers MFU. MFU is achieved FLOP/s over
the accelerator's dense bf16 peak.
"""

from __future__ import annotations

from jdist.models.runs import window_of

# Dense bf16 peak TFLOP/s per device, by jax `device_kind` prefix (vendor data sheets).
PEAK_TFLOPS = {"NVIDIA H200": 989.0, "NVIDIA H100": 989.0, "NVIDIA A100": 312.0,
               "TPU v4": 275.0, "TPU v5 lite": 197.0, "TPU v5p": 459.0, "TPU v6 lite": 918.0}


def attention_params(model) -> int:
    """One layer's q, k, v and output projection weights (MLA's latent projections)."""
    return model.attention_matmuls()


def score_flops(model, seq_len: int) -> float:
    """Training FLOPs per token of attention's scores (q.k, head_dim wide) and context
    (p.v, MLA's v_head_dim wide), in every block and the MTP module's: each query against
    `seq_len` keys, or a sliding window's (`models.runs.window_of`) where it is shorter."""
    keys = sum(min(seq_len, window_of(model, i) or seq_len) for i in range(model.n_layers))
    keys += model.mtp_depth * seq_len
    return 6.0 * model.n_heads * (model.dim_per_head + model.value_dim) * keys


def flops_per_token(model, seq_len: int) -> float:
    """Training FLOPs per token of `model` at sequence length `seq_len`; with multi-token
    prediction, its block, its projection and its pass through the head too."""
    d = model.d_model
    attention = attention_params(model)
    # A block with experts: the routed k, the router, a shared expert; a dense block (all of
    # a dense model's, a heterogeneous stack's first ones): its SwiGLU.
    moe = 3 * d * model.d_ff * model.top_k + d * model.n_experts \
        + 3 * d * model.shared_d_ff + d * model.shared_gate
    dense = 3 * d * (model.dense_d_ff or model.d_ff)
    matmul_params = model.n_layers * attention + model.moe_layers * moe \
        + (model.n_layers - model.moe_layers) * dense + d * model.vocab_size  # + head
    matmul_params += model.mtp_depth * (attention + dense + 2 * d * d + d * model.vocab_size)
    return 6.0 * matmul_params + score_flops(model, seq_len)


def peak_tflops(device_kind: str, override: float = 0.0) -> float:
    """The per-device peak for MFU: `--peak-tflops`, else the table, else 0 (unknown)."""
    if override:
        return override
    return next((v for k, v in PEAK_TFLOPS.items() if device_kind.startswith(k)), 0.0)


def utilisation(tokens_per_sec: float, flops: float, n_devices: int, peak: float) -> dict:
    """Achieved TFLOP/s per device, and MFU when the peak is known."""
    achieved = tokens_per_sec * flops / n_devices / 1e12
    return {"tflops_per_device": achieved, **({"mfu": achieved / peak} if peak else {})}

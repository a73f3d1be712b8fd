"""Model FLOPs per token and the utilisation metrics of a run."""

import json

import pytest

from jdist.config import TrainConfig
from jdist.models import get_preset
from jdist.tools.throughput import flops_per_token, peak_tflops, utilisation
from jdist.train.loop import train


def test_flops_per_token_counts_what_each_token_multiplies():
    tiny = get_preset("tiny")  # d 64, 8 heads of 8, 4 kv heads, d_ff 128, vocab 256, 2 layers
    per_layer = 64 * 8 * (2 * 8 + 2 * 4) + 3 * 64 * 128
    want = 6 * (2 * per_layer + 64 * 256) + 12 * 2 * 8 * 8 * 32
    assert flops_per_token(tiny, 32) == want
    # A sliding window of 8: its layers' queries attend to 8 keys, not 32 (gpt-oss's
    # alternation: the first layer windowed, the second full).
    local = get_preset("tiny", sliding_window=8)
    assert flops_per_token(local, 32) == want - 12 * 2 * 8 * 8 * (32 - 8)
    alternating = get_preset("tiny", sliding_window=8, full_attention_every=2)
    assert flops_per_token(alternating, 32) == want - 12 * 8 * 8 * (32 - 8)
    # MoE: only the top-k experts a token is routed to (and the router) count.
    moe = get_preset("moe-tiny")
    dense_like = get_preset("moe-tiny", n_experts=0, d_ff=moe.d_ff * moe.top_k)
    router = 6 * moe.n_layers * moe.d_model * moe.n_experts
    assert flops_per_token(moe, 32) == flops_per_token(dense_like, 32) + router
    # 7b: about 6 x 6.7e9 parameters per token, as the usual estimate says.
    assert flops_per_token(get_preset("7b"), 2048) / (6 * 6.7e9) == pytest.approx(1.0, rel=0.12)


def test_mfu_needs_a_known_peak():
    assert peak_tflops("cpu") == 0.0 and peak_tflops("NVIDIA H200") == 989.0
    assert peak_tflops("cpu", override=2.0) == 2.0
    assert utilisation(1e6, 1e6, 8, 0.0) == {"tflops_per_device": 1e12 / 8 / 1e12}
    assert utilisation(1e6, 1e6, 1, 2.0)["mfu"] == pytest.approx(0.5)


def test_metrics_report_throughput(tmp_path):
    train(TrainConfig.of(model="tiny", mesh="dp=2", steps=2, batch_size=4, seq_len=32,
                         eval_every=0, run_dir=str(tmp_path), peak_tflops=1.0))
    record = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])
    want = record["tokens_per_sec"] * flops_per_token(get_preset("tiny"), 32) / 2 / 1e12
    assert record["tflops_per_device"] == pytest.approx(want)
    assert record["mfu"] == pytest.approx(record["tflops_per_device"])

"""Loss masks: targets of -1 are not counted, and the loss is the global sum over counted
tokens divided by their global count, so every layout and micro-batching computes the same
loss and gradients even when its pieces count different numbers of tokens."""

import jax
import numpy as np
import pytest

from jdist import data
from jdist.models import get_preset
from jdist.models.loss import IGNORE, cross_entropy
from jdist.parallel.pipeline import PipelineConfig
from jdist.step.state import build_model
from jdist.tools.equivalence import assert_matches, config, train_steps

TINY = get_preset("tiny")
BATCH, SEQ = 16, 32
_CORPUS = data.load_corpus(None, seq_len=128).train


def masked_batch(step: int) -> dict:
    """The usual windows with a ragged prefix of every row's targets masked (row r loses
    (5r + 3 step) % 40 of its 32 targets: some rows keep all, some none), so replicas and
    micro-batches count different numbers of tokens."""
    b = data.host_batch(_CORPUS, 0, step, BATCH, SEQ)
    cut = (5 * np.arange(BATCH) + 3 * step) % 40
    b["targets"] = np.where(np.arange(SEQ)[None, :] < cut[:, None], IGNORE, b["targets"])
    return b


def test_uneven_masks_really_are_uneven():
    counts = (masked_batch(0)["targets"] >= 0).sum(1)
    assert counts.min() == 0 and counts.max() == SEQ
    assert len({counts[i::4].sum() for i in range(4)}) > 1  # micro-batches of 4 differ


def test_loss_is_the_mean_over_counted_tokens(single_device):
    """Step 0's loss against the model's own logits, averaged over counted tokens only."""
    run = single_device(TINY, batch_fn=masked_batch)
    b = masked_batch(0)
    with jax.default_matmul_precision("highest"):
        logits = jax.jit(build_model(TINY, 0))(b["inputs"])
    ce = np.asarray(cross_entropy(logits, np.maximum(b["targets"], 0)))
    keep = b["targets"] >= 0
    np.testing.assert_allclose(run.losses[0], ce[keep].mean(), rtol=1e-6)
    assert abs(run.losses[0] - ce.mean()) > 1e-3  # the mask changed it


@pytest.mark.parametrize("mesh, settings", [
    ("dp=8", {}),
    ("dp=2,fsdp=2,tp=2", {"grad_accum": 4}),  # micro-batches of 1 row per replica
    ("pp=2", {"pipeline": PipelineConfig("1f1b", 4)}),
])
def test_masked_loss_matches_single_device(single_device, mesh, settings):
    flags = {k: v for k, v in settings.items() if k != "pipeline"}
    run = train_steps(TINY, mesh, _CORPUS, config(batch_size=BATCH, seq_len=SEQ, **flags),
                      pipeline=settings.get("pipeline"), batch_fn=masked_batch)
    assert_matches(run, single_device(TINY, batch_fn=masked_batch))

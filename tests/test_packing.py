"""Packed documents (`jdist.data.packing`): the loss of a packed batch equals the documents'
losses computed one by one, for every attention implementation and through a pipeline.

The model is the Hugging Face fixture `llama-untied` (weights N(0, 0.5), so what a token
sees changes its loss a lot; a freshly initialised model barely looks at its context)."""

import jax
import numpy as np
import pytest
from flax import nnx

from jdist.config import TrainConfig
from jdist.data.packing import document_layout
from jdist.hf.config import model_config
from jdist.hf.load import load_params
from jdist.models.loss import cross_entropy
from jdist.parallel.pipeline import PipelineConfig
from jdist.step.from_flags import plan_for
from jdist.tools.equivalence import config, train_steps

HF = "tests/fixtures/hf/llama-untied"
MODEL = model_config(HF)
EOD = 316  # the fixture tokenizer's <|end_of_text|>
BATCH, SEQ = 4, 64


def documents() -> list[list[np.ndarray]]:
    """Per row, documents [EOD, text...] of ragged lengths that fill SEQ + 1 tokens exactly
    (the row's last token is the next document's EOD)."""
    rng = np.random.default_rng(7)
    rows = []
    for r in range(BATCH):
        lengths = [(5, 17, 30, 12), (64,), (1, 40, 23), (33, 31)][r]
        rows.append([np.concatenate([[EOD], rng.integers(0, EOD, n - 1)]) for n in lengths])
    return rows


def packed_batch(step: int) -> dict:
    rows = np.stack([np.concatenate([*docs, [EOD]]) for docs in documents()]).astype(np.int32)
    return {"inputs": rows[:, :-1], "targets": rows[:, 1:]}


def test_layout_restarts_at_each_document():
    seg, pos = map(np.asarray, document_layout(np.array([[5, EOD, 7, 8, EOD, 9]]), EOD))
    assert seg.tolist() == [[0, 1, 1, 1, 2, 2]] and pos.tolist() == [[0, 0, 1, 2, 0, 1]]


@pytest.fixture(scope="module")
def separate_loss() -> float:
    """Each document run on its own (its own sequence, positions from 0): the mean over all
    documents' tokens of their cross-entropy, each predicting its next token (the last one
    the following EOD). One batch, each document padded at its end to SEQ: causal attention
    keeps padding out of the document's own positions."""
    _, plan, _ = plan_for(TrainConfig.of(init_from=HF, mesh="dp=1"))
    model = nnx.merge(plan.graphdef, jax.tree.map(np.asarray, load_params(HF, plan)))
    docs = [doc for row in documents() for doc in row]
    inputs = np.zeros((len(docs), SEQ), np.int32)
    targets = np.zeros((len(docs), SEQ), np.int32)
    for i, doc in enumerate(docs):
        inputs[i, :len(doc)] = doc
        targets[i, :len(doc)] = np.concatenate([doc[1:], [EOD]])
    with jax.default_matmul_precision("highest"):
        ce = np.asarray(cross_entropy(model(inputs), targets), np.float64)
    keep = np.arange(SEQ)[None, :] < np.array([len(d) for d in docs])[:, None]
    return float(ce[keep].mean())


@pytest.mark.parametrize("mesh, settings", [
    ("dp=1", {"attention": "xla", "loss": "full"}),
    ("dp=1", {"attention": "flash"}),
    ("sp=2", {"cp_strategy": "ring"}),
    ("dp=2,sp=2", {"cp_strategy": "all_gather"}),
    ("sp=2,tp=2", {"cp_strategy": "ulysses"}),
    ("tp=2", {"tp_halves": True}),  # segment ids and per-row rotary tables split with x
    ("pp=2", {"pipeline": PipelineConfig("1f1b", 2)}),
])
def test_packed_loss_is_the_documents_loss(corpus, separate_loss, mesh, settings):
    flags = {k: v for k, v in settings.items() if k != "pipeline"}
    run = train_steps(MODEL, mesh, corpus.train,
                      config(steps=1, batch_size=BATCH, seq_len=SEQ, init_from=HF, **flags),
                      pipeline=settings.get("pipeline"), eod_id=EOD, batch_fn=packed_batch)
    np.testing.assert_allclose(run.losses[0], separate_loss, rtol=2e-6)


def test_unpacked_loss_differs(corpus, separate_loss):
    """The same rows without document masks: the comparison above can fail."""
    run = train_steps(MODEL, "dp=1", corpus.train,
                      config(steps=1, batch_size=BATCH, seq_len=SEQ, attention="xla",
                             init_from=HF), batch_fn=packed_batch)
    # ~1% off (about 5000x the tolerance above)
    assert abs(run.losses[0] - separate_loss) > 1e-3 * separate_loss

"""Weighted mixtures of data sources: `--data a.txt:0.7,b.bin:0.3`.

Each source loads as it would alone, with its own held-out tail. A batch's rows are divided
between the sources in proportion to the weights: source j gets floor(batch x w_j) rows, and
the rows left over go to sources by systematic sampling on the fractional parts, so each
batch is as close to the weights as whole rows allow and the expected share of every source
is its weight exactly. The rows are then shuffled (a source's rows do not all land on one
replica) and each reads a random window of its source. All of it is a pure function of
(seed, stream, step), like a single source's batch: the same rows for every mesh and process
count, and a resumed run goes on exactly where it stopped (a checkpoint's data position is
its step).
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from pathlib import Path

import numpy as np

from jdist import data
from jdist.errors import require

SEPARATOR, WEIGHT = ",", ":"


def parse(spec: str) -> list[tuple[str, float]] | None:
    """`A:0.7,B:0.3` -> [(A, 0.7), (B, 0.3)] (weights are relative); None for one plain
    source: empty (the builtin corpus), or a path that exists as written."""
    if not spec or Path(spec).exists() or not (SEPARATOR in spec or WEIGHT in spec):
        return None
    parts = []
    for part in spec.split(SEPARATOR):
        path, _, text = part.strip().rpartition(WEIGHT)
        try:
            weight = float(text)
        except ValueError:
            weight = math.nan
        require(bool(path) and math.isfinite(weight) and weight > 0,
                f"--data part {part!r} is not PATH:WEIGHT with a positive weight; write a "
                "mixture as --data a.txt:0.7,b.bin:0.3 (or one source alone as --data a.txt)")
        parts.append((path, weight))
    return parts


@dataclasses.dataclass(frozen=True)
class Mixture:
    parts: tuple[data.Corpus, ...]
    weights: tuple[float, ...]  # summing to 1

    def draws(self, seed: int, step: int, batch_size: int, seq_len: int,
              stream: int = data.TRAIN_STREAM) -> tuple[np.ndarray, np.ndarray]:
        """Each row's source and window start at (seed, step). Pure; independent of the mesh."""
        rng = np.random.default_rng((seed, stream, step))
        exact = batch_size * np.asarray(self.weights)
        counts = np.floor(exact).astype(np.int64)
        left = batch_size - int(counts.sum())
        if left:  # systematic sampling: source j gets one more with probability frac_j
            cum = np.cumsum(exact - counts)
            points = rng.random() + np.arange(left)
            counts += np.bincount(np.searchsorted(cum * (left / cum[-1]), points, "right"),
                                  minlength=len(counts))
        sources = rng.permutation(np.repeat(np.arange(len(counts)), counts))
        lengths = np.array([len(self.tokens(j, stream)) for j in range(len(self.parts))])
        return sources, rng.integers(0, lengths[sources] - seq_len - 1)

    def tokens(self, j: int, stream: int) -> np.ndarray:
        return self.parts[j].train if stream == data.TRAIN_STREAM else self.parts[j].val

    def rows(self, sources, starts, seq_len: int, stream: int) -> np.ndarray:
        return np.stack([np.asarray(self.tokens(j, stream)[s: s + seq_len + 1], np.int32)
                         for j, s in zip(sources, starts)])

    def host_batch(self, seed: int, step: int, batch_size: int, seq_len: int,
                   stream: int = data.TRAIN_STREAM) -> dict[str, np.ndarray]:
        """The whole global batch on the host (reference runs, tests)."""
        rows = self.rows(*self.draws(seed, step, batch_size, seq_len, stream), seq_len, stream)
        return {"inputs": rows[:, :-1], "targets": rows[:, 1:]}

    def global_batch(self, seed: int, step: int, batch_size: int, seq_len: int, sharding,
                     stream: int = data.TRAIN_STREAM) -> dict:
        """The global batch as sharded `jax.Array`s; this process reads only its devices' rows."""
        sources, starts = self.draws(seed, step, batch_size, seq_len, stream)
        return data.sharded_windows(
            lambda r: self.rows(sources[r], starts[r], seq_len, stream), batch_size, seq_len,
            sharding)

    def corpus(self) -> data.Corpus:
        """What the rest of training reads of its data: the vocabulary and eod id the
        sources share, and a description. Its token arrays are empty: the sources hold them
        (token counts: `counts`)."""
        source = "mixture of " + ", ".join(f"{w:.0%} {c.source}"
                                          for c, w in zip(self.parts, self.weights))
        notes = "; ".join(c.note for c in self.parts if c.note)
        empty = np.zeros(0, self.parts[0].train.dtype)
        return data.Corpus(empty, empty, max(c.vocab_size for c in self.parts), source,
                           self.parts[0].eod_id, note=notes)

    def counts(self) -> tuple[int, int]:
        """Train and validation tokens, all sources together."""
        return (sum(len(c.train) for c in self.parts), sum(len(c.val) for c in self.parts))

    def fingerprint(self) -> str:
        """The sources' fingerprints and the weights: a resumed run checks both."""
        text = ";".join(f"{data.fingerprint(c)}:{w!r}" for c, w in zip(self.parts, self.weights))
        return hashlib.sha256(text.encode()).hexdigest()[:16]


def load(parts: list[tuple[str, float]], seq_len: int, bin_dtype: str | None = None,
         tokenizer=None, text_column: str = "text") -> Mixture:
    """Every source loaded (each checked as it would be alone), and checked to share one
    tokenization: ids of one vocabulary cannot be mixed with another's."""
    for path, _ in parts:  # as `DataFlags.validate` says of a single source
        require(not path.endswith(".jsonl"), f"--data source {path} is JSON lines, which "
                "would be trained on as raw JSON text; run python -m jdist.data tokenize "
                f"{path} --out FILE.bin and mix FILE.bin")
    corpora = [data.load_corpus(None if path == data.BUILTIN else path, seq_len, bin_dtype,
                                tokenizer=tokenizer, text_column=text_column)
               for path, _ in parts]
    kind = lambda c: "bytes" if c.train.dtype == np.uint8 else f"token ids, eod id {c.eod_id}"
    for c in corpora[1:]:
        require(kind(c) == kind(corpora[0]),
                f"--data sources {corpora[0].source!r} ({kind(corpora[0])}) and {c.source!r} "
                f"({kind(c)}) are not tokenized alike; pass --tokenizer with the one the .bin "
                "files were made with, or tokenize every source with it")
    total = sum(w for _, w in parts)
    return Mixture(tuple(corpora), tuple(w / total for _, w in parts))

"""Supervised fine-tuning data (`--data FILE.jsonl --data-format sft`, or Hugging Face
.parquet/.arrow files with those columns, `jdist.data.hf_files`): prompt/completion or chat
records, packed into rows whose loss counts only the answers.

Each record is one packed document, `[separator] + prompt ids + answer ids` (the separator
opens a document, `jdist.data.packing`). Targets predicting prompt tokens are IGNORE; those
predicting answer tokens are counted, and so is the one after the last answer token (the
eos: the model learns where the answer ends) unless the record ends with an eos of its own.
Chat records are rendered with the tokenizer's chat template the way transformers renders
it; an assistant message's tokens are what its turn adds to the prompt rendered with
`add_generation_prompt`, up to and including the token that closes the turn
(`chat.turn_end`; what the template writes after it, a newline, belongs to the next
prompt). The separator is the eos, unless the template closes every turn with the eos
(SmolLM2's <|im_end|>): one conversation would then be cut into documents that cannot see
each other, so another end-of-text token of the tokenizer separates them.
Records fill rows of seq_len + 1 tokens in file order; a batch is a pure function of
(seed, step), a permutation per epoch.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from jdist.data import TRAIN_STREAM, VAL_FRACTION, Corpus, hf_files, jsonl_records, truncation
from jdist.data.chat import chat_template, render, turn_end
from jdist.data.tokenizer import EOD_CANDIDATES, Tokenizer
from jdist.errors import ConfigError, require
from jdist.models.loss import IGNORE

TEXT, SFT = "text", "sft"
FORMATS = (TEXT, SFT)
ASSISTANT = "assistant"


@dataclasses.dataclass(frozen=True)
class SftRows:
    tokens: np.ndarray   # int32 [n_rows, seq_len + 1]
    targets: np.ndarray  # int32 [n_rows, seq_len], shifted: IGNORE where not counted


@dataclasses.dataclass(frozen=True)
class SftData:
    train: SftRows
    val: SftRows
    source: str
    eod_id: int
    records: int
    counted: int    # counted targets, train and validation
    truncated: int  # records cut to one row (their end is not counted)
    lengths: np.ndarray = dataclasses.field(  # each record's document, in tokens
        default_factory=lambda: np.zeros(0, np.int64))

    def corpus(self) -> Corpus:
        """What the rest of training reads of its data (the source and token counts it
        reports, the fingerprint a resumed run compares): the rows' tokens and targets."""
        train, val = self.train.tokens.reshape(-1), self.val.tokens.reshape(-1)
        vocab = int(max(train.max(), val.max())) + 1
        return Corpus(train, val, vocab, self.source, self.eod_id,
                      (self.train.targets.reshape(-1), self.val.targets.reshape(-1)))

    def summary(self) -> str:
        return (f"sft data {self.source}: {self.records:,} records in {len(self.train.tokens):,}"
                f" train / {len(self.val.tokens):,} val rows, {self.counted:,} counted tokens, "
                f"{self.truncated:,} truncated (longer than a row)")


def records(path: Path) -> Iterator[tuple[str, dict]]:
    """(`FILE:LINE`, record) of every non-empty line (`FILE row N` of every table row), each
    checked to be one of the formats."""
    read = hf_files.records if hf_files.table_files(path) else jsonl_records
    for where, record, _ in read(path):
        require(isinstance(record, dict) and (is_pair(record) or "messages" in record),
                f"{where} has neither \"prompt\" and \"completion\" nor \"messages\"; an sft "
                "record is {\"prompt\": ..., \"completion\": ...} or {\"messages\": [{\"role\":"
                " ..., \"content\": ...}, ...]}")
        require(all(isinstance(t, str) for t in _texts(record)), f"{where}: prompt, "
                "completion and every message's role and content must be strings; fix it")
        yield where, record


def is_pair(record: dict) -> bool:
    """A prompt/completion record (else a chat record)."""
    return {"prompt", "completion"} <= record.keys()


def _texts(record: dict) -> list:
    if is_pair(record):
        return [record["prompt"], record["completion"]]
    messages = record["messages"]
    if not isinstance(messages, list):
        return [None]
    return [t for m in messages for t in
            ((m.get("role"), m.get("content")) if isinstance(m, dict) else (None,))]


def pieces(record: dict, where: str, tokenizer: Tokenizer, template) -> list[tuple[str, bool]]:
    """The record's text as (text, counted) pieces, in order (each is encoded on its own)."""
    if is_pair(record):
        return [(record["prompt"], False), (record["completion"], True)]
    messages = record["messages"]
    require(template is not None, f"{where} is a chat record but tokenizer {tokenizer.name!r} "
            "has no chat template (chat_template in tokenizer_config.json); use one with a "
            "template or prompt/completion records")
    turns = [i for i, m in enumerate(messages) if m["role"] == ASSISTANT]
    require(bool(turns), f"{where} has no message with role {ASSISTANT!r}: nothing to train on")
    out, done = [], ""
    for i in turns:
        prompt = render(template, tokenizer, messages[:i], True, where)
        answer = render(template, tokenizer, messages[: i + 1], False, where)
        require(prompt.startswith(done) and answer.startswith(prompt),
                f"{where}: the chat template is not prefix-stable at message {i} (a rendering is"
                " not a prefix of the next), so the assistant's tokens cannot be found; use "
                "prompt/completion records")
        said, after = closed(answer[len(prompt):], template, tokenizer)
        out += [(prompt[len(done):], False), (said, True), (after, False)]
        done = answer
    full = render(template, tokenizer, messages, False, where)
    require(full.startswith(done), f"{where}: the chat template is not prefix-stable after "
            "the last assistant message; use prompt/completion records")
    return out + [(full[len(done):], False)]


def closed(turn: str, template, tokenizer: Tokenizer) -> tuple[str, str]:
    """An assistant turn's text as (what the assistant says, up to and including the token
    that closes its turn; what the template writes after that)."""
    end = turn_end(template, tokenizer)
    marker = "" if end is None else tokenizer.decode([end])
    cut = turn.rfind(marker) + len(marker) if marker and marker in turn else len(turn)
    return turn[:cut], turn[cut:]


def separator(tokenizer: Tokenizer, template) -> int:
    """The id that opens each packed document: the eos id, unless `template` closes every
    turn with it; then the tokenizer's first other end-of-text token (SmolLM2's
    <|endoftext|>), if it has one."""
    eos = tokenizer.eod_id
    if template is None or turn_end(template, tokenizer) != eos:
        return eos
    others = (tokenizer.token_id(c) for c in EOD_CANDIDATES)
    return next((i for i in others if i is not None and i != eos), eos)


def document(record: dict, where: str, tokenizer: Tokenizer, template,
             sep: int | None = None):
    """(tokens, targets) of one record's document, both of its length: `[sep] + ids`, and
    what each position predicts (its next id, IGNORE unless counted; the last, the eos).
    `sep`: the separator (default: `separator(tokenizer, template)`)."""
    eos = tokenizer.eod_id
    sep = separator(tokenizer, template) if sep is None else sep
    parts = [(tokenizer.encode(text).astype(np.int32), c) for text, c in
             pieces(record, where, tokenizer, template) if text]
    ids = np.concatenate([p for p, _ in parts] + [np.zeros(0, np.int32)])
    counted = np.concatenate([np.full(len(p), c) for p, c in parts] + [np.zeros(0, bool)])
    if sep in ids[:-1] and not is_pair(record) and sep == turn_end(template, tokenizer):
        raise ConfigError(
            f"{where}: tokenizer {tokenizer.name!r} closes every chat turn with its eos token "
            f"(id {eos}), which also separates packed documents, and has no other end-of-text "
            f"token ({', '.join(EOD_CANDIDATES)}) to separate them with; add one to its "
            "tokenizer.json, or write the records as prompt/completion")
    require(sep not in ids[:-1], f"{where} holds the end-of-document token (id {sep}) before "
            "its end; packed documents start at every one, so what follows would not see "
            "what precedes it; split the record or remove the token")
    # The answer's end is predicted (a chat record's only if it ends with an answer), unless
    # the record ends with an eos of its own.
    answered = is_pair(record) or (len(ids) > 0 and bool(counted[-1]))
    closes = answered and not (len(ids) > 0 and ids[-1] == eos)
    targets = np.append(np.where(counted, ids, IGNORE), eos if closes else IGNORE)
    return np.concatenate([[sep], ids]).astype(np.int32), targets.astype(np.int32)


def pack(docs, seq_len: int, eod: int) -> tuple[np.ndarray, np.ndarray, int]:
    """Fill rows in order. A document fits a row if its closing target does (at most seq_len
    tokens); a longer one is cut to a row of its own. The tail is eod tokens, not counted."""
    rows_t, rows_y, truncated, used = [], [], 0, seq_len + 1
    for tokens, targets in docs:
        if len(tokens) > seq_len:
            truncated += 1
        if used + min(len(tokens), seq_len + 1) > seq_len:  # start a new row
            rows_t.append(np.full(seq_len + 1, eod, np.int32))
            rows_y.append(np.full(seq_len, IGNORE, np.int32))
            used = 0
        n = min(len(tokens), seq_len + 1)
        m = min(n, seq_len - used)  # a cut document loses its last target
        rows_t[-1][used: used + n], rows_y[-1][used: used + m] = tokens[:n], targets[:m]
        used += n
    shape = (len(rows_t), seq_len + 1)
    return (np.stack(rows_t) if rows_t else np.zeros(shape, np.int32),
            np.stack(rows_y) if rows_y else np.zeros((0, seq_len), np.int32), truncated)


def load_sft(path: str, tokenizer: Tokenizer, seq_len: int,
             val_fraction: float = VAL_FRACTION) -> SftData:
    """The rows of an sft JSONL file, split into train and the last `val_fraction` of rows."""
    p = Path(path)
    require(p.is_file() or bool(hf_files.table_files(p)), f"data path {path!r} does not "
            "exist or is not a file; pass a .jsonl of sft records (or .parquet/.arrow files)")
    template, lengths = chat_template(tokenizer), []
    sep = separator(tokenizer, template)

    def docs():
        for where, record in records(p):
            doc = document(record, where, tokenizer, template, sep)
            lengths.append(len(doc[0]))
            yield doc

    tokens, targets, truncated = pack(docs(), seq_len, sep)
    n, n_rec = len(tokens), len(lengths)
    n_val = max(1, int(n * val_fraction))
    require(n_rec > 0, f"{path!r} holds no records; add prompt/completion or messages lines")
    require(n - n_val >= 1, f"{path!r}: {n_rec} records fill {n} row of --seq-len {seq_len}, "
            f"too few for a training and a validation row; give at least {2 * n_rec} records "
            "like these or a shorter --seq-len")
    cut = n - n_val
    return SftData(SftRows(tokens[:cut], targets[:cut]), SftRows(tokens[cut:], targets[cut:]),
                   f"{path} (sft, {tokenizer.name})", sep, n_rec,
                   int((targets != IGNORE).sum()), truncated, np.array(lengths, np.int64))


def for_training(config, tokenizer: Tokenizer) -> SftData:
    """`--data-format sft`: the flags it needs checked, the rows loaded, the summary said."""
    from jdist.runtime.distributed import is_main_process

    given = repr(config.data.path) if config.data.path else "the builtin corpus"
    require(config.data.path.endswith(".jsonl") or hf_files.is_table(config.data.path) or
            bool(config.data.path and hf_files.table_files(Path(config.data.path))),
            "--data-format sft reads a .jsonl of records (or .parquet/.arrow files of them), "
            f"not {given}; pass --data FILE.jsonl")
    require(bool(config.data.tokenizer), "--data-format sft needs --tokenizer (a Hugging Face "
            "tokenizer directory, with its chat template for messages records)")
    loaded = load_sft(config.data.path, tokenizer, config.data.seq_len)
    cut = truncation.check(loaded.lengths, config.data.seq_len, config.data.allow_truncation)
    if is_main_process():
        print(loaded.summary(), flush=True)
        if loaded.eod_id != tokenizer.eod_id:
            print(f"sft data: documents are separated by {tokenizer.decode([loaded.eod_id])} "
                  f"(id {loaded.eod_id}): the chat template closes every turn with the eos, "
                  f"{tokenizer.decode([tokenizer.eod_id])}", flush=True)
        if cut:
            print(f"jdist: warning: {cut}", file=sys.stderr, flush=True)
    return loaded


@functools.lru_cache(maxsize=8)
def _permutation(seed: int, stream: int, epoch: int, n_rows: int) -> np.ndarray:
    order = np.random.default_rng((seed, stream, epoch)).permutation(n_rows)
    order.flags.writeable = False
    return order


def row_indices(n_rows: int, seed: int, step: int, batch_size: int,
                stream: int = TRAIN_STREAM) -> np.ndarray:
    """The rows of (seed, step): sample i = step * batch_size + k is position i % n of epoch
    i // n's permutation, so each epoch sees every row once. Pure; independent of the mesh."""
    epoch, pos = np.divmod(step * batch_size + np.arange(batch_size, dtype=np.int64), n_rows)
    return np.array([_permutation(seed, stream, int(e), n_rows)[p] for e, p in zip(epoch, pos)],
                    dtype=np.int64)


def host_sft_batch(rows: SftRows, seed: int, step: int, batch_size: int,
                   stream: int = TRAIN_STREAM) -> dict[str, np.ndarray]:
    """The whole global batch on the host (reference runs, tests)."""
    idx = row_indices(len(rows.tokens), seed, step, batch_size, stream)
    return {"inputs": rows.tokens[idx, :-1], "targets": rows.targets[idx]}


def sft_batch(rows: SftRows, seed: int, step: int, batch_size: int, sharding,
              stream: int = TRAIN_STREAM) -> dict:
    """The global batch as sharded `jax.Array`s; this process reads only its devices' rows."""
    import jax

    idx = row_indices(len(rows.tokens), seed, step, batch_size, stream)
    shape = (batch_size, rows.targets.shape[1])

    def make(source: np.ndarray):
        return jax.make_array_from_callback(
            shape, sharding, lambda index: source[idx[index[0]], : shape[1]][:, index[1]])

    return {"inputs": make(rows.tokens), "targets": make(rows.targets)}

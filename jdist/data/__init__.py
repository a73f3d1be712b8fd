"""Token data and deterministic global batches.

A global batch is a pure function of (seed, step): the same rows for every mesh and
every process count, so runs are comparable across parallel configurations and
resumable from any step. Each process materialises only the rows (and columns) its
own devices hold.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import sysconfig
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from jdist.data.text import read_text, text_files
from jdist.errors import ConfigError, require

if TYPE_CHECKING:
    from jdist.data.tokenizer import Tokenizer

BYTE_VOCAB = 256
BUILTIN = "builtin"
BUILTIN_MAX_BYTES = 16 << 20
VAL_FRACTION = 0.05
TRAIN_STREAM, VAL_STREAM = 0, 1


@dataclasses.dataclass(frozen=True)
class Corpus:
    train: np.ndarray  # 1-D token ids
    val: np.ndarray
    vocab_size: int  # smallest vocabulary that covers the ids
    source: str
    eod_id: int | None = None  # end-of-document id; None: byte-level (newline-separated)
    # (train, val) targets when the loss does not count every next token (sft rows: IGNORE
    # where not counted); None: every next token counts.
    targets: tuple[np.ndarray, np.ndarray] | None = None
    note: str = ""  # said after the counts at start (where cached tokens came from)


def encode(text: str | bytes) -> np.ndarray:
    """Byte-level tokenizer: every byte is one token id in [0, 256)."""
    raw = text.encode("utf-8") if isinstance(text, str) else text
    return np.frombuffer(raw, dtype=np.uint8)


def decode(ids) -> str:
    return bytes(np.asarray(ids, dtype=np.uint8)).decode("utf-8", errors="replace")


def builtin_text(max_bytes: int = BUILTIN_MAX_BYTES) -> bytes:
    """The Python standard library's own source: real text that every machine with Python has."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py")
                   if "site-packages" not in p.parts and "dist-packages" not in p.parts)
    chunks, total = [], 0
    for path in files:
        chunk = path.read_bytes()
        chunks.append(chunk)
        total += len(chunk)
        if total >= max_bytes:
            break
    return b"\n".join(chunks)[:max_bytes]


def builtin_tokens(tokenizer: Tokenizer | None, max_bytes: int = BUILTIN_MAX_BYTES,
                   where: Path | None = None) -> tuple[np.ndarray, str]:
    """The built-in corpus's ids, and what to tell the user about them. With a Hugging Face
    tokenizer they come from the token cache (`jdist.data.cache`, in `where` or the default
    directory), keyed by the tokenizer's digest and the corpus bytes' hash: reading an
    entry takes a fraction of the encoding's time (docs/measurements.md#token-cache)."""
    text = builtin_text(max_bytes)
    digest = getattr(tokenizer, "digest", None)
    if tokenizer is None or tokenizer.eod_id is None or digest is None:
        return encode(text), ""  # bytes: the text is the ids
    from jdist.data import cache

    start = time.perf_counter()
    name = "builtin-" + cache.key(hashlib.sha256(text).hexdigest(), digest())
    ids, path, hit = cache.cached(name, lambda: _encode_documents([text], tokenizer), where)
    if hit:
        return ids, f"tokens read from the cache {path}"
    return ids, (f"tokenized in {time.perf_counter() - start:.1f}s, cached in {path} "
                 "(python -m jdist.data clear-cache deletes it)")


def sidecar_path(path: str | Path) -> Path:
    """`FILE.bin.json`: how `python -m jdist.data tokenize` wrote FILE.bin (dtype, eod id)."""
    return Path(str(path) + ".json")


def read_sidecar(path: str | Path) -> dict:
    """A `.bin`'s sidecar, or {} when it has none."""
    side = sidecar_path(path)
    if not side.is_file():
        return {}
    try:
        meta = json.loads(side.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{str(side)!r} is not readable JSON ({e}); delete it or re-run "
                          "python -m jdist.data tokenize") from None
    require(isinstance(meta, dict), f"{str(side)!r} is not a JSON object; delete it or re-run "
                                    "python -m jdist.data tokenize")
    return meta


def recorded_vocab(path: str | None) -> int | None:
    """The vocabulary a `.bin`'s sidecar records (its tokenizer's), or None: not a `.bin`, or
    no sidecar."""
    if not (path and str(path).endswith(".bin")):
        return None
    vocab = read_sidecar(path).get("vocab_size")
    require(vocab is None or (isinstance(vocab, int) and vocab > 0),
            f"{str(sidecar_path(path))!r} records vocab_size {vocab!r}, not a positive "
            "integer; delete it or re-run python -m jdist.data tokenize")
    return vocab


def _bin_dtype(path: Path, given: str | None) -> str:
    """The sidecar's dtype, else --data-dtype, else uint16; the two disagreeing is a mistake."""
    found = read_sidecar(path).get("dtype")
    require(not (given and found and given != found),
            f"--data-dtype {given} but {str(sidecar_path(path))!r} says {str(path)!r} holds "
            f"{found} ids; drop --data-dtype or pass {found}")
    return given or found or "uint16"


def _encode_documents(docs: list[bytes], tokenizer: Tokenizer | None) -> np.ndarray:
    """Bytes: the documents joined by newlines, as ever. Otherwise exactly what
    `python -m jdist.data tokenize` writes: each non-empty document's ids, then the eod id."""
    if tokenizer is None or tokenizer.eod_id is None:
        return encode(b"\n".join(docs))
    from jdist.data.tokenize import encode_chunk

    texts = [t for t in (d.decode("utf-8", errors="replace") for d in docs) if t]
    return encode_chunk(tokenizer, texts)


def _eod_id(path: str | None, tokenizer: Tokenizer | None) -> int | None:
    """A `.bin`'s eod id from its sidecar (which must match an explicit tokenizer), else the
    tokenizer's."""
    eod = None if tokenizer is None else tokenizer.eod_id
    if not (path and path.endswith(".bin")):
        return eod
    meta = read_sidecar(path)
    if meta and eod is not None:
        require(meta.get("eod_id") == eod and meta.get("vocab_size") == tokenizer.vocab_size,
                f"{path!r} was tokenized with {meta.get('tokenizer')} (vocabulary "
                f"{meta.get('vocab_size')}, eod id {meta.get('eod_id')}) but --tokenizer "
                f"{tokenizer.name} has vocabulary {tokenizer.vocab_size}, eod id {eod}; pass "
                "the tokenizer the file was made with")
    return meta.get("eod_id", eod)


def jsonl_records(path: Path) -> Iterator[tuple[str, object, int]]:
    """(`FILE:LINE`, parsed value, bytes) of every non-empty line of a JSONL file; a line
    that is not JSON is a one-line error naming it."""
    import json

    with path.open("rb") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{n}"
            try:
                record = json.loads(line)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise ConfigError(f"{where} is not valid JSON ({e}); fix the line or drop "
                                  "the file") from None
            yield where, record, len(line)


def load_tokens(path: str | None, bin_dtype: str | None = None,
                tokenizer: Tokenizer | None = None,
                text_column: str = "text") -> tuple[np.ndarray, str, str]:
    """All token ids of a data source: builtin corpus, text file, directory of text, `.bin`
    (its dtype from its sidecar, else `bin_dtype`, else uint16), or Hugging Face tables
    (`jdist.data.hf_files`: `.parquet`/`.arrow` files or a directory of them, one document
    per row of `text_column`), its description and a note (where cached ids came from). Text
    is encoded by `tokenizer` (default: bytes); a `.bin` is already ids."""
    named = "" if tokenizer is None or tokenizer.eod_id is None else f" ({tokenizer.name})"
    if path in (None, "", BUILTIN):
        tokens, note = builtin_tokens(tokenizer)
        return tokens, "python stdlib source (builtin)" + named, note
    p = Path(path)
    require(p.exists(), f"data path {path!r} does not exist; pass a text file, a directory "
                        "of text files, or a .bin of token ids (or omit --data for the builtin "
                        "corpus)")
    from jdist.data import hf_files

    if hf_files.table_files(p):
        docs = hf_files.texts(p, text_column)
        return _encode_documents(docs, tokenizer), \
            f"{path} ({len(docs):,} rows of {text_column!r}){named}", ""
    if p.is_dir():
        files = text_files(p)
        require(bool(files), f"data directory {path!r} has no text files; add .txt files or "
                             "point --data elsewhere")
        return _encode_documents([read_text(f) for f in files], tokenizer), \
            f"{len(files)} files in {path}{named}", ""
    if p.suffix == ".bin":
        bin_dtype = _bin_dtype(p, bin_dtype)
        require(bin_dtype in ("uint16", "uint32"),
                f"--data-dtype {bin_dtype!r} is not supported; use uint16 or uint32")
        itemsize = np.dtype(bin_dtype).itemsize
        require(p.stat().st_size % itemsize == 0,
                f"{path!r} has {p.stat().st_size} bytes, not a whole number of {bin_dtype} "
                "tokens; check --data-dtype or re-export the file")
        require(p.stat().st_size > 0, f"{path!r} is empty; point --data at a file of token ids")
        return np.memmap(p, dtype=bin_dtype, mode="r"), f"{path} ({bin_dtype} token ids)", ""
    return _encode_documents([read_text(p)], tokenizer), f"{path}{named}", ""


def load_corpus(path: str | None, seq_len: int, bin_dtype: str | None = None,
                val_fraction: float = VAL_FRACTION, tokenizer: Tokenizer | None = None,
                text_column: str = "text") -> Corpus:
    """Split a source into train and held-out validation tokens (the last `val_fraction`)."""
    tokens, source, note = load_tokens(path, bin_dtype, tokenizer, text_column)
    n_train, n_val = split_sizes(len(tokens), val_fraction)
    if min(n_train, n_val) < seq_len + 2:
        longest = min(n_train, n_val) - 2
        raise ConfigError(
            f"data {source!r} has {len(tokens)} tokens, too few for --seq-len {seq_len}: the "
            f"training split and the validation split (the last {val_fraction:.0%}) each need "
            f"seq_len + 2 = {seq_len + 2} tokens, {tokens_needed(seq_len, val_fraction)} in "
            "all; give more text" + (f" or pass --seq-len {longest} or less" if longest >= 2
                                     else ""))
    vocab = BYTE_VOCAB if tokens.dtype == np.uint8 else int(tokens.max()) + 1
    return Corpus(tokens[:n_train], tokens[n_train:], vocab, source, _eod_id(path, tokenizer),
                  note=note)


def split_sizes(n_tokens: int, val_fraction: float = VAL_FRACTION) -> tuple[int, int]:
    """(training, validation) tokens of a source: the last `val_fraction`, rounded down, is
    held out."""
    n_val = int(n_tokens * val_fraction)
    return n_tokens - n_val, n_val


def tokens_needed(seq_len: int, val_fraction: float = VAL_FRACTION) -> int:
    """The fewest tokens `load_corpus` takes for `seq_len`: both splits need seq_len + 2,
    since a window is seq_len + 1 tokens and `window_starts` draws its start below
    n - seq_len - 1."""
    window = seq_len + 2
    n = max(2 * window, math.ceil(window / val_fraction))
    while min(split_sizes(n, val_fraction)) < window:  # int() rounded the held-out part down
        n += 1
    return n


def window_starts(n_tokens: int, seed: int, step: int, batch_size: int, seq_len: int,
                  stream: int = TRAIN_STREAM) -> np.ndarray:
    """Start offsets of the `batch_size` windows of (seed, step). Pure; independent of the mesh."""
    rng = np.random.default_rng((seed, stream, step))
    return rng.integers(0, n_tokens - seq_len - 1, size=batch_size)


def batch_rows(tokens: np.ndarray, starts: np.ndarray, seq_len: int) -> np.ndarray:
    """Windows of seq_len + 1 tokens (inputs plus the next-token targets), int32."""
    return np.stack([np.asarray(tokens[s: s + seq_len + 1], dtype=np.int32) for s in starts])


def host_batch(tokens: np.ndarray, seed: int, step: int, batch_size: int, seq_len: int,
               stream: int = TRAIN_STREAM) -> dict[str, np.ndarray]:
    """The whole global batch on the host (reference runs, tests)."""
    rows = batch_rows(tokens, window_starts(len(tokens), seed, step, batch_size, seq_len, stream),
                      seq_len)
    return {"inputs": rows[:, :-1], "targets": rows[:, 1:]}


def global_batch(tokens: np.ndarray, seed: int, step: int, batch_size: int, seq_len: int,
                 sharding, stream: int = TRAIN_STREAM) -> dict:
    """The global batch as sharded `jax.Array`s; this process reads only its devices' rows."""
    starts = window_starts(len(tokens), seed, step, batch_size, seq_len, stream)
    return sharded_windows(lambda rows: batch_rows(tokens, starts[rows], seq_len), batch_size,
                           seq_len, sharding)


def sharded_windows(rows, batch_size: int, seq_len: int, sharding) -> dict:
    """Inputs and targets as sharded `jax.Array`s from `rows(slice)`, the windows (seq_len + 1
    tokens) of a slice of the batch's rows: each slice this process's devices hold is read
    once, and no other."""
    import jax

    shape = (batch_size, seq_len)
    cache: dict[tuple, np.ndarray] = {}

    def read(index: tuple) -> np.ndarray:
        key = (index[0].start, index[0].stop)
        if key not in cache:
            cache[key] = rows(index[0])
        return cache[key]

    def make(shift: int):
        return jax.make_array_from_callback(
            shape, sharding, lambda index: read(index)[:, shift: shift + seq_len][:, index[1]])

    return {"inputs": make(0), "targets": make(1)}


def fingerprint(corpus: Corpus, full_limit: int = 1 << 28) -> str:
    """A digest of the token stream, and of the loss's targets when they are not the next
    tokens (sft: two files of the same tokens may count different ones), so a resumed run can
    tell it is training on the same data (the builtin corpus is whatever stdlib this Python
    has). Streams larger than `full_limit` bytes are sampled: length, both ends, and an even
    stride through them."""
    h = hashlib.sha256()
    for part in (corpus.train, corpus.val, *(corpus.targets or ())):
        h.update(f"{part.dtype}:{len(part)};".encode())
        if part.nbytes <= full_limit:
            h.update(np.ascontiguousarray(part).tobytes())
        else:
            step = max(1, len(part) // (1 << 20))
            h.update(np.ascontiguousarray(part[::step]).tobytes())
            h.update(np.ascontiguousarray(part[-(1 << 20):]).tobytes())
    return h.hexdigest()[:16]


def check_vocab(corpus: Corpus, vocab_size: int) -> None:
    if corpus.vocab_size > vocab_size:
        raise ConfigError(f"data {corpus.source!r} has token ids up to {corpus.vocab_size - 1} but "
                          f"the model vocabulary is {vocab_size}; pass --vocab-size "
                          f"{corpus.vocab_size} or larger, or re-tokenize it with a vocabulary of "
                          f"at most {vocab_size}")

"""Tokenizers: the byte-level default and Hugging Face `tokenizer.json` files.

End-of-document policy: a Hugging Face tokenizer must name an end-of-document token (its eos
token), which follows every document. The byte tokenizer has no such id (all 256 ids are
bytes): its documents are separated by a newline byte, as the byte-level corpus always was.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

from jdist.data import BYTE_VOCAB, decode, encode
from jdist.errors import ConfigError, require

BYTES = "bytes"
# Tried in order when tokenizer_config.json names no eos/bos token (Llama 3, GPT-2, Llama 2,
# Gemma spellings).
EOD_CANDIDATES = ("<|end_of_text|>", "<|endoftext|>", "</s>", "<eos>")
BOS_CANDIDATES = ("<|begin_of_text|>", "<s>", "<bos>")


def id_dtype(vocab_size: int) -> np.dtype:
    """The narrowest unsigned dtype that stores every id of a vocabulary (for `.bin` files)."""
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


class Tokenizer:
    """Text to ids and back. `spec` reloads it (`load_tokenizer(spec)`), e.g. in a worker."""

    name: str
    spec: str
    vocab_size: int
    eod_id: int | None
    bos_id: int | None = None

    def encode(self, text: str) -> np.ndarray:
        raise NotImplementedError

    def decode(self, ids) -> str:
        raise NotImplementedError

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [self.encode(t) for t in texts]

    def encode_prompt(self, text: str) -> np.ndarray:
        """A prompt as `transformers` encodes it (`tokenizer(text)`, add_special_tokens=True):
        with the special tokens the tokenizer's own post-processor adds, if any."""
        return self.encode(text)

    def token_id(self, text: str) -> int | None:
        """The id of a token of the vocabulary, spelled `text` (None: no such token)."""
        return None

    def is_special(self, token: int) -> bool:
        """Whether `token` is a special token (a chat template's markers, eos)."""
        return False

    def separator(self) -> np.ndarray:
        """The ids that follow every document: the eod id, or a newline for bytes."""
        return encode(b"\n") if self.eod_id is None else np.array([self.eod_id], np.uint32)


class ByteTokenizer(Tokenizer):
    name = spec = BYTES
    vocab_size = BYTE_VOCAB
    eod_id = None

    def encode(self, text: str) -> np.ndarray:
        return encode(text)

    def decode(self, ids) -> str:
        return decode(ids)


class HFTokenizer(Tokenizer):
    """A Hugging Face `tokenizers` tokenizer; encodes without adding special tokens."""

    def __init__(self, path: Path, name: str, special: dict):
        from tokenizers import Tokenizer as _HF

        try:
            self._tok = _HF.from_file(str(path))
        except Exception as e:  # the library raises a bare Exception on bad JSON
            reason = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise ConfigError(f"tokenizer file {str(path)!r} cannot be read ({reason}); "
                              "pass a valid tokenizer.json or its directory") from None
        self.spec = self.name = name
        self.file = path
        vocab = self._tok.get_vocab(with_added_tokens=True)
        # Ids may have holes; .bin dtypes and the model's embedding must cover the largest.
        self.vocab_size = max(self._tok.get_vocab_size(with_added_tokens=True),
                              max(vocab.values()) + 1)
        self.eod_id = self._special(special.get("eos_token"), EOD_CANDIDATES, path, "eos")
        require(self.eod_id is not None,
                f"tokenizer {self.name!r} has no end-of-document token (no eos_token in "
                f"tokenizer_config.json and none of {', '.join(EOD_CANDIDATES)} in its "
                "vocabulary); add eos_token to tokenizer_config.json")
        self.bos_id = self._special(special.get("bos_token"), BOS_CANDIDATES, path, "bos")

    def _special(self, token: str | None, candidates: tuple, path: Path, kind: str):
        if token is not None:
            found = self._tok.token_to_id(token)
            require(found is not None, f"tokenizer_config.json next to {str(path)!r} names "
                    f"{kind}_token {token!r}, which is not in tokenizer.json's vocabulary; fix "
                    "one of the two files")
            return found
        ids = [self._tok.token_to_id(c) for c in candidates]
        return next((i for i in ids if i is not None), None)

    def digest(self) -> str:
        """What the ids of a text depend on, as a hash (the token cache's key): the
        tokenizer.json bytes, the eod id that follows each document, the vocabulary (the
        ids' dtype) and the `tokenizers` version that encodes."""
        import tokenizers

        h = hashlib.sha256(self.file.read_bytes())
        h.update(f";eod={self.eod_id};vocab={self.vocab_size};"
                 f"tokenizers={tokenizers.__version__}".encode())
        return h.hexdigest()

    def token_id(self, text: str) -> int | None:
        return self._tok.token_to_id(text)

    def is_special(self, token: int) -> bool:
        added = self._tok.get_added_tokens_decoder().get(token)
        return added is not None and added.special

    def encode(self, text: str) -> np.ndarray:
        return np.array(self._tok.encode(text, add_special_tokens=False).ids, np.uint32)

    def encode_prompt(self, text: str) -> np.ndarray:
        # The post-processor decides (Llama 3's prepends <|begin_of_text|>; one without a
        # template adds nothing even when a bos token is named), as in transformers.
        return np.array(self._tok.encode(text, add_special_tokens=True).ids, np.uint32)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        # Multithreaded in Rust (RAYON_NUM_THREADS / TOKENIZERS_PARALLELISM); order is kept.
        out = self._tok.encode_batch_fast(texts, add_special_tokens=False)
        return [np.array(e.ids, np.uint32) for e in out]

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)


def _token_text(value) -> str | None:
    """tokenizer_config.json writes special tokens as a string or {"content": ...}."""
    return value.get("content") if isinstance(value, dict) else value


def _read_special(config: Path) -> dict:
    if not config.is_file():
        return {}
    try:
        raw = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{str(config)!r} is not readable JSON ({e}); fix or delete it") \
            from None
    require(isinstance(raw, dict), f"{str(config)!r} is not a JSON object; fix or delete it")
    return {k: _token_text(raw.get(k)) for k in ("eos_token", "bos_token")}


def _names_bytes(config: Path) -> bool:
    """Whether tokenizer_config.json says the tokenizer is jdist's byte tokenizer (as
    `jdist.export` writes it next to the model, in the HF form transformers loads)."""
    try:
        return json.loads(config.read_text(encoding="utf-8")).get("jdist_tokenizer") == BYTES
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError):
        return False  # _read_special reports an unreadable file


def load_tokenizer(spec: str | None) -> Tokenizer:
    """"" or "bytes": byte-level; a directory with tokenizer.json (and optionally
    tokenizer_config.json for eos/bos); or a path to a tokenizer.json."""
    if spec in (None, "", BYTES):
        return ByteTokenizer()
    p = Path(spec).expanduser().resolve()
    fix = "pass a Hugging Face tokenizer directory or its tokenizer.json (or bytes)"
    require(p.exists(), f"tokenizer {spec!r} does not exist; {fix}")
    if p.is_dir():
        file = p / "tokenizer.json"
        require(file.is_file(), f"tokenizer directory {spec!r} has no tokenizer.json; {fix}")
        if _names_bytes(p / "tokenizer_config.json"):
            return ByteTokenizer()
        return HFTokenizer(file, str(p), _read_special(p / "tokenizer_config.json"))
    return HFTokenizer(p, str(p), _read_special(p.parent / "tokenizer_config.json"))


def train_bpe(texts, vocab_size: int, out_dir: str | Path, eod: str = EOD_CANDIDATES[0]) -> Path:
    """Train a byte-level BPE tokenizer (GPT-2 style, so any text round-trips) on an iterable
    of strings and save `out_dir/tokenizer.json`; for tests, benchmarks and small corpora."""
    from tokenizers import Tokenizer as _HF
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = _HF(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[eod],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer)
    path = Path(out_dir) / "tokenizer.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(path))
    return path

"""Tokenizers and `python -m jdist.data tokenize`: ids match Hugging Face's, the .bin holds
every document followed by the eod id whatever the worker count, mistakes are one line with
nothing written, and training reads the result. No compilation."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from jdist import data
from jdist.data.tokenizer import id_dtype, load_tokenizer, train_bpe
from jdist.errors import ConfigError

FIXTURE = Path(__file__).parent / "fixtures" / "hf" / "tokenizer"
TEXTS = ["Hello, world!", "def f(x):\n    return x + 1\n", "naïve café — 東京 🚀", " \t\n", ""]


def run_tokenize(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "jdist.data", "tokenize", *args],
                          check=False, capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> Path:
    """A 300-id byte-level BPE trained on a few KB of text, with <|end_of_text|>."""
    text = data.builtin_text(32_000).decode("utf-8", errors="replace")
    return train_bpe(text.splitlines(), 300, tmp_path_factory.mktemp("tok")).parent


@pytest.fixture
def corpus_inputs(tmp_path) -> tuple[list[str], list[str]]:
    """A directory (two text files, a hidden and a binary one skipped) and a .jsonl file;
    returns the input paths and the documents in the order they must come out."""
    docs = tmp_path / "docs"
    (docs / "sub").mkdir(parents=True)
    (docs / "b.txt").write_text("second file\n" * 40)
    (docs / "sub" / "a.txt").write_text("first file: import os\n" * 30)  # sub/ sorts after b
    (docs / ".hidden.txt").write_text("skipped")
    (docs / "blob.dat").write_bytes(b"\0\1\2" * 50)
    records = [{"text": f"record {i}: " + "la " * (i * 20), "id": i} for i in range(5)]
    jsonl = tmp_path / "recs.jsonl"
    jsonl.write_text("\n".join(json.dumps(r) for r in records) + "\n\n")
    expected = [(docs / "b.txt").read_text(), (docs / "sub" / "a.txt").read_text()]
    return [str(docs), str(jsonl)], expected + [r["text"] for r in records]


@pytest.mark.skipif(not (FIXTURE / "reference.json").exists(), reason="no HF fixture")
def test_ids_match_transformers_reference():
    ref = json.loads((FIXTURE / "reference.json").read_text())
    tok = load_tokenizer(str(FIXTURE))
    assert (tok.vocab_size, tok.eod_id, tok.bos_id) == (ref["vocab_size"], ref["eos_token_id"],
                                                        ref["bos_token_id"])
    for sample in ref["samples"]:
        assert tok.encode(sample["text"]).tolist() == sample["ids"], sample["text"]
        assert tok.decode(sample["ids"]) == sample["decoded"]


def test_round_trip_and_special_tokens(tok_dir):
    for tok in (load_tokenizer(str(tok_dir)), load_tokenizer(str(tok_dir / "tokenizer.json")),
                load_tokenizer("")):
        for text in TEXTS:
            assert tok.decode(tok.encode(text)) == text
    hf, byte = load_tokenizer(str(tok_dir)), load_tokenizer("bytes")
    assert hf.vocab_size == 300 and hf.eod_id == 0 and hf.bos_id is None  # from the vocab
    assert byte.vocab_size == 256 and byte.eod_id is None
    assert [b.tolist() for b in hf.encode_batch(TEXTS)] == [hf.encode(t).tolist() for t in TEXTS]
    assert id_dtype(65536) == np.uint16 and id_dtype(65537) == np.uint32


def test_cli_writes_documents_then_eod_the_same_for_any_worker_count(tmp_path, tok_dir,
                                                                      corpus_inputs):
    inputs, docs = corpus_inputs
    tok = load_tokenizer(str(tok_dir))
    expected = np.concatenate([p for d in docs for p in (tok.encode(d), [tok.eod_id])])
    outputs = []
    for workers in ("1", "2"):
        out = tmp_path / f"w{workers}.bin"
        result = run_tokenize(*inputs, "--tokenizer", str(tok_dir), "--out", str(out),
                              "--workers", workers)
        assert result.returncode == 0, result.stderr
        assert result.stdout.count("\n") == 1 and "7 documents" in result.stdout
        outputs.append(out.read_bytes())
    np.testing.assert_array_equal(np.frombuffer(outputs[0], np.uint16), expected)
    assert outputs[0] == outputs[1]
    meta = json.loads((tmp_path / "w1.bin.json").read_text())
    assert meta == {"tokenizer": str(tok_dir), "dtype": "uint16", "vocab_size": 300,
                    "eod_id": 0, "documents": 7, "tokens": len(expected)}
    # Training on the text with the same tokenizer sees exactly the file's ids.
    corpus = data.load_corpus(inputs[0], seq_len=8, tokenizer=tok)
    from_bin = data.load_corpus(str(tmp_path / "w1.bin"), seq_len=8)
    n_dir = sum(len(tok.encode(d)) + 1 for d in docs[:2])
    np.testing.assert_array_equal(np.concatenate([corpus.train, corpus.val]), expected[:n_dir])
    assert from_bin.eod_id == corpus.eod_id == 0 and from_bin.train.dtype == np.uint16


def test_vocabulary_beyond_uint16_writes_uint32(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(70_000)} | {"<|endoftext|>": 70_000, "[UNK]": 70_001}
    hf = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    hf.pre_tokenizer = pre_tokenizers.Whitespace()
    hf.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "in.txt").write_text("w1 w65535 w69999 w3")
    out = tmp_path / "big.bin"
    result = run_tokenize(str(tmp_path / "in.txt"), "--tokenizer", str(tmp_path), "--out",
                          str(out))
    assert result.returncode == 0, result.stderr
    assert json.loads((tmp_path / "big.bin.json").read_text())["dtype"] == "uint32"
    assert np.fromfile(out, np.uint32).tolist() == [1, 65535, 69999, 3, 70_000]


BAD = [
    (lambda p: [str(p / "missing.txt")], "does not exist"),
    (lambda p: [str(p / "nofield.jsonl")], "nofield.jsonl:2 has no field 'text'"),
    (lambda p: [str(p / "badjson.jsonl")], "badjson.jsonl:3 is not valid JSON"),
    (lambda p: [str(p / "empty.txt")], "hold no documents"),
    (lambda p: [str(p / "good.txt"), "--tokenizer", str(p / "nowhere")], "tokenizer"),
    (lambda p: [str(p / "good.txt"), "--tokenizer", str(p / "badtok.json")], "cannot be read"),
    (lambda p: [str(p / "good.txt"), str(p / "latin1.txt")],
     "latin1.txt is not UTF-8 text (byte 0xe9 at offset 3)"),
]


@pytest.mark.parametrize("args, message", BAD, ids=[m.split(" ")[0] for _, m in BAD])
def test_bad_input_is_one_line_exit_2_and_nothing_written(tmp_path, tok_dir, args, message):
    (tmp_path / "nofield.jsonl").write_text('{"text": "a"}\n{"body": "b"}\n')
    (tmp_path / "badjson.jsonl").write_text('{"text": "a"}\n\n{"text": oops}\n')
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "good.txt").write_text("fine")
    (tmp_path / "latin1.txt").write_bytes("café".encode("latin-1"))
    (tmp_path / "badtok.json").write_text("{not json")
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    args = args(tmp_path)
    if "--tokenizer" not in args:
        args += ["--tokenizer", str(tok_dir)]
    result = run_tokenize(*args, "--out", str(out_dir / "data.bin"))
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith("jdist: error: ") and result.stderr.count("\n") == 1
    assert message in result.stderr, result.stderr
    assert list(out_dir.iterdir()) == []


def test_bin_beyond_model_vocab_is_refused_in_one_line(tmp_path, tok_dir):
    (tmp_path / "in.txt").write_text("hello hello world " * 200)
    out = tmp_path / "data.bin"
    assert run_tokenize(str(tmp_path / "in.txt"), "--tokenizer", str(tok_dir), "--out",
                        str(out)).returncode == 0
    corpus = data.load_corpus(str(out), seq_len=8)
    with pytest.raises(ConfigError, match="pass --vocab-size") as e:
        data.check_vocab(corpus, 256)
    assert str(out) in str(e.value) and "\n" not in str(e.value)


def test_training_takes_the_dtype_from_the_sidecar(tmp_path):
    ids = (np.arange(5000) * 7919 % 100_000).astype(np.uint32)
    ids.tofile(tmp_path / "ids.bin")
    (tmp_path / "ids.bin.json").write_text(json.dumps({"dtype": "uint32", "eod_id": 99_999}))
    corpus = data.load_corpus(str(tmp_path / "ids.bin"), seq_len=8)
    np.testing.assert_array_equal(np.concatenate([corpus.train, corpus.val]), ids)
    assert corpus.eod_id == 99_999 and corpus.vocab_size == int(ids.max()) + 1
    assert data.load_corpus(str(tmp_path / "ids.bin"), 8, "uint32").train.dtype == np.uint32
    with pytest.raises(ConfigError, match="--data-dtype uint16 but .* holds uint32"):
        data.load_corpus(str(tmp_path / "ids.bin"), seq_len=8, bin_dtype="uint16")


def test_training_takes_the_vocabulary_from_the_sidecar(tmp_path, tok_dir):
    """A .bin's model vocabulary is the one its sidecar records (no --vocab-size needed); a
    larger --vocab-size pads it, a smaller one is refused in one line."""
    from jdist.config import TrainConfig
    from jdist.train.setup import prepare

    (tmp_path / "in.txt").write_text("hello hello world " * 200)
    out = tmp_path / "data.bin"
    assert run_tokenize(str(tmp_path / "in.txt"), "--tokenizer", str(tok_dir), "--out",
                        str(out)).returncode == 0
    flags = dict(model="tiny", mesh="dp=1", data=str(out), seq_len=8)
    assert prepare(TrainConfig.of(**flags)).model.vocab_size == 300
    assert prepare(TrainConfig.of(**flags, vocab_size=320)).model.vocab_size == 320
    with pytest.raises(ConfigError) as refused:
        prepare(TrainConfig.of(**flags, vocab_size=256))
    assert str(refused.value) == (
        f"--vocab-size 256 is smaller than the vocabulary of 300 that {out}.json records for "
        f"--data {out}; drop --vocab-size (the model then takes 300) or pass 300 or more")


def test_prepare_refuses_a_tokenizer_larger_than_the_model(tok_dir):
    from jdist.config import TrainConfig
    from jdist.train.setup import prepare

    with pytest.raises(ConfigError, match="has 300 tokens .* pass --vocab-size 300 or larger"):
        prepare(TrainConfig.of(model="tiny", mesh="dp=1", tokenizer=str(tok_dir)))


def test_builtin_corpus_tokens_are_cached_by_tokenizer_and_corpus(tok_dir, tmp_path,
                                                                   monkeypatch):
    """The first run with a tokenizer encodes the built-in corpus and stores the ids; the
    second reads them back, identical, from $JDIST_CACHE_DIR/tokens. Another tokenizer is
    another entry; an unreadable entry is rewritten; concurrent writers leave one whole
    entry and no temporary files; clear-cache empties the directory."""
    import threading

    from jdist.data import cache

    monkeypatch.setenv("JDIST_CACHE_DIR", str(tmp_path))
    where = tmp_path / "tokens"
    tok = load_tokenizer(str(tok_dir))
    fresh = data._encode_documents([data.builtin_text(200_000)], tok)  # what a miss computes
    first, said = data.builtin_tokens(tok, max_bytes=200_000)
    assert "cached in" in said and str(where) in said, said
    (entry,) = where.iterdir()
    second, said = data.builtin_tokens(tok, max_bytes=200_000)
    assert said == f"tokens read from the cache {entry}"
    np.testing.assert_array_equal(first, fresh)
    np.testing.assert_array_equal(second, fresh)
    assert second.dtype == fresh.dtype == first.dtype
    # A hit is the entry's ids, not a re-encoding: what the file holds comes back.
    np.save(entry, fresh[::-1])
    assert (data.builtin_tokens(tok, max_bytes=200_000)[0] == fresh[::-1]).all()
    entry.write_bytes(b"truncated")  # unreadable: a miss, encoded again and rewritten
    again, said = data.builtin_tokens(tok, max_bytes=200_000)
    assert "cached in" in said and (again == fresh).all() and (np.load(entry) == fresh).all()
    # Another corpus (or tokenizer) is another entry.
    other, _ = data.builtin_tokens(tok, max_bytes=100_000)
    assert len(other) < len(fresh) and len(list(where.iterdir())) == 2
    # Runs that miss together: each writes a temporary file and renames it into place.
    ids, name, results = fresh, "builtin-concurrent", []
    workers = [threading.Thread(target=lambda: results.append(cache.cached(name, lambda: ids)))
               for _ in range(4)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert len(results) == 4 and all((r[0] == ids).all() for r in results)
    assert (np.load(where / f"{name}.npy") == ids).all()
    assert sorted(p.suffix for p in where.iterdir()) == [".npy"] * 3  # no temporary files
    assert subprocess.run([sys.executable, "-m", "jdist.data", "clear-cache"], check=True,
                          capture_output=True, text=True).stdout.startswith("deleted 3 cached")
    assert not list(where.iterdir())

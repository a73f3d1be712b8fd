import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jdist import data
from jdist.errors import ConfigError
from jdist.spmd.mesh import build_mesh


def test_builtin_corpus_is_real_python_source(corpus):
    text = data.decode(corpus.train[:200_000])
    assert "def " in text and "import " in text
    assert corpus.vocab_size == 256 and len(corpus.val) > 0


def test_batches_are_a_pure_function_of_seed_and_step(corpus):
    a = data.host_batch(corpus.train, seed=1, step=5, batch_size=8, seq_len=16)
    b = data.host_batch(corpus.train, seed=1, step=5, batch_size=8, seq_len=16)
    c = data.host_batch(corpus.train, seed=1, step=6, batch_size=8, seq_len=16)
    np.testing.assert_array_equal(a["inputs"], b["inputs"])
    assert not np.array_equal(a["inputs"], c["inputs"])
    np.testing.assert_array_equal(a["inputs"][:, 1:], a["targets"][:, :-1])


@pytest.mark.parametrize("mesh, spec", [("dp=8", P("data")), ("dp=2,fsdp=2,sp=2",
                                         P(("data", "fsdp"), "sequence")), ("tp=8", P())])
def test_global_batch_is_identical_for_every_mesh(corpus, mesh, spec):
    sharding = NamedSharding(build_mesh(mesh), spec)
    batch = data.global_batch(corpus.train, 0, 3, 16, 32, sharding)
    ref = data.host_batch(corpus.train, 0, 3, 16, 32)
    for key in ("inputs", "targets"):
        assert batch[key].sharding == sharding
        np.testing.assert_array_equal(np.asarray(batch[key]), ref[key])


def test_validation_stream_differs_from_training(corpus):
    train = data.host_batch(corpus.val, 0, 0, 4, 16, data.TRAIN_STREAM)
    val = data.host_batch(corpus.val, 0, 0, 4, 16, data.VAL_STREAM)
    assert not np.array_equal(train["inputs"], val["inputs"])


def test_text_file_directory_and_bin(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.txt").write_text("hello world " * 500)
    (tmp_path / "docs" / "b.md").write_text("more text " * 500)
    (tmp_path / "docs" / "blob.dat").write_bytes(b"\0\1\2" * 100)
    corpus = data.load_corpus(str(tmp_path / "docs"), seq_len=16)
    assert len(corpus.train) + len(corpus.val) == 6000 + 5000 + 1
    ids = np.arange(20_000, dtype=np.uint32) % 50_000 + 1000
    ids.tofile(tmp_path / "tokens.bin")
    corpus = data.load_corpus(str(tmp_path / "tokens.bin"), seq_len=16, bin_dtype="uint32")
    assert corpus.vocab_size == int(ids.max()) + 1
    with pytest.raises(ConfigError, match="pass --vocab-size 21000"):
        data.check_vocab(corpus, 256)


@pytest.mark.parametrize("setup, fragment", [
    (lambda p: p / "missing.txt", "does not exist"),
    (lambda p: (p / "empty.txt").write_text("") and None or p / "empty.txt", "too few"),
    (lambda p: (p / "d").mkdir() or p / "d", "has no text files"),
    (lambda p: (p / "odd.bin").write_bytes(b"123") and None or p / "odd.bin", "whole number"),
])
def test_bad_data(tmp_path, setup, fragment):
    with pytest.raises(ConfigError, match=fragment):
        data.load_corpus(str(setup(tmp_path)), seq_len=16)


def test_too_little_data_says_exactly_what_is_needed(tmp_path):
    """Both splits need seq_len + 2 tokens (the validation split, the last 5%, binds): 360
    bytes load for --seq-len 16, 359 do not, and the message says so (it once asked for
    681)."""
    assert data.tokens_needed(16) == 360
    (tmp_path / "enough.txt").write_bytes(b"x" * 360)
    corpus = data.load_corpus(str(tmp_path / "enough.txt"), seq_len=16)
    assert (len(corpus.train), len(corpus.val)) == (342, 18)
    (tmp_path / "short.txt").write_bytes(b"x" * 359)
    with pytest.raises(ConfigError) as refused:
        data.load_corpus(str(tmp_path / "short.txt"), seq_len=16)
    assert str(refused.value).endswith(
        "has 359 tokens, too few for --seq-len 16: the training split and the validation "
        "split (the last 5%) each need seq_len + 2 = 18 tokens, 360 in all; give more text "
        "or pass --seq-len 15 or less")
    data.load_corpus(str(tmp_path / "short.txt"), seq_len=15)  # as the message says


def test_each_process_reads_only_its_rows(corpus, monkeypatch):
    # make_array_from_callback asks only for addressable rows; count the rows materialised.
    seen = []
    original = data.batch_rows
    monkeypatch.setattr(data, "batch_rows",
                        lambda t, s, n: seen.append(len(s)) or original(t, s, n))
    sharding = NamedSharding(build_mesh("dp=8"), P("data"))
    data.global_batch(corpus.train, 0, 0, 16, 32, sharding)
    assert sum(seen) == 16 and max(seen) == 2  # eight devices, two rows each, read once
    assert jax.process_count() == 1


def test_fingerprint_tells_data_apart(tmp_path):
    (tmp_path / "a.txt").write_text("hello world " * 500)
    a = data.load_corpus(str(tmp_path / "a.txt"), seq_len=16)
    b = data.load_corpus(str(tmp_path / "a.txt"), seq_len=16)
    (tmp_path / "a.txt").write_text("hello world " * 499 + "hello there ")
    c = data.load_corpus(str(tmp_path / "a.txt"), seq_len=16)
    assert data.fingerprint(a) == data.fingerprint(b) != data.fingerprint(c)

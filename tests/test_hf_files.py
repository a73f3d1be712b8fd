"""Hugging Face datasets' files read directly (`jdist.data.hf_files`): Parquet, Arrow IPC
streams (the `datasets` cache and save_to_disk) and IPC files, written here by pyarrow (and
by `datasets` where it is installed), as training text, as sft records and as input to
`python -m jdist.data tokenize`; mistakes are one line. No compilation."""

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.feather as feather
import pyarrow.parquet as pq
import pytest

from jdist import data
from jdist.data import sft
from jdist.data.tokenize import tokenize
from jdist.data.tokenizer import load_tokenizer
from jdist.errors import ConfigError

TOK = Path(__file__).parent / "fixtures" / "hf" / "tokenizer"
TEXTS = [f"document {i}: naïve café, def f(x): return {i} * x\n" * (1 + i % 3)
         for i in range(60)]


def table(texts=TEXTS) -> pa.Table:
    return pa.table({"id": list(range(len(texts))), "content": texts})


def write_stream(path: Path, t: pa.Table) -> Path:
    """What `datasets` writes to its cache and save_to_disk: an Arrow IPC stream."""
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, t.schema) as writer:
        writer.write_table(t, max_chunksize=7)  # several record batches
    return path


@pytest.fixture
def files(tmp_path) -> dict[str, Path]:
    """The same rows as Parquet, an Arrow stream, an Arrow IPC file and a dataset directory
    of two Parquet shards (with a README.md dataset card that is not data)."""
    pq.write_table(table(), tmp_path / "a.parquet", row_group_size=16)
    feather.write_feather(table(), tmp_path / "a-file.arrow")
    shards = tmp_path / "dataset" / "data"
    shards.mkdir(parents=True)
    (tmp_path / "dataset" / "README.md").write_text("---\nlicense: mit\n---\n# card\n" * 50)
    pq.write_table(table(TEXTS[:25]), shards / "train-00000-of-00002.parquet")
    pq.write_table(table(TEXTS[25:]), shards / "train-00001-of-00002.parquet")
    return {"parquet": tmp_path / "a.parquet", "stream": write_stream(tmp_path / "a.arrow",
                                                                      table()),
            "ipc file": tmp_path / "a-file.arrow", "dataset dir": tmp_path / "dataset"}


@pytest.mark.parametrize("kind", ["parquet", "stream", "ipc file", "dataset dir"])
def test_every_row_is_a_document(files, tmp_path, kind):
    plain = tmp_path / "plain.txt"
    plain.write_text("\n".join(TEXTS))  # bytes: documents joined by newlines, as for files
    expect = data.load_corpus(str(plain), seq_len=16)
    got = data.load_corpus(str(files[kind]), seq_len=16, text_column="content")
    np.testing.assert_array_equal(np.concatenate([got.train, got.val]),
                                  np.concatenate([expect.train, expect.val]))
    assert "60 rows of 'content'" in got.source
    tok = load_tokenizer(str(TOK))
    ids = data.load_tokens(str(files[kind]), tokenizer=tok, text_column="content")[0]
    assert np.array_equal(ids, np.concatenate([np.append(tok.encode(t), tok.eod_id)
                                               for t in TEXTS]))


def test_tokenize_reads_tables_like_jsonl(files, tmp_path):
    jsonl = tmp_path / "a.jsonl"
    jsonl.write_text("".join(json.dumps({"content": t}) + "\n" for t in TEXTS))
    ref = tokenize([str(jsonl)], str(TOK), str(tmp_path / "ref.bin"), "content",
                   progress=False)
    for kind in ("parquet", "stream", "dataset dir"):
        out = tmp_path / f"{kind.replace(' ', '-')}.bin"
        result = tokenize([str(files[kind])], str(TOK), str(out), "content", progress=False)
        assert result["documents"] == ref["documents"] == len(TEXTS)
        assert out.read_bytes() == (tmp_path / "ref.bin").read_bytes()
        assert 0 < result["input_bytes"] <= sum(p.stat().st_size for p in
                                                 [files[kind], *files[kind].rglob("*")]
                                                 if p.is_file())


def test_sft_records_from_parquet_match_jsonl(tmp_path):
    records = [{"messages": [{"role": "user", "content": f"Square of {i}?"},
                             {"role": "assistant", "content": f"{i * i}"}]} for i in range(20)]
    records += [{"prompt": f"Twice {i}?", "completion": f" {2 * i}"} for i in range(20)]
    jsonl = tmp_path / "chat.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in records))
    # One table holds both kinds: a row's missing columns are null.
    columns = ("prompt", "completion", "messages")
    pq.write_table(pa.table({c: [r.get(c) for r in records] for c in columns}),
                   tmp_path / "chat.parquet")
    tok = load_tokenizer(str(TOK))
    a = sft.load_sft(str(jsonl), tok, 64)
    b = sft.load_sft(str(tmp_path / "chat.parquet"), tok, 64)
    assert (a.records, a.counted, a.truncated) == (b.records, b.counted, b.truncated) == \
        (40, a.counted, 0)
    for x, y in ((a.train, b.train), (a.val, b.val)):
        np.testing.assert_array_equal(x.tokens, y.tokens)
        np.testing.assert_array_equal(x.targets, y.targets)


@pytest.mark.parametrize("column, says", [
    ("text", "has no column 'text' (its columns: id, content); name the one that holds"),
    ("id", "column 'id' of"),
])
def test_a_wrong_column_is_one_line(files, column, says):
    with pytest.raises(ConfigError, match=r"^[^\n]*$") as e:
        data.load_corpus(str(files["parquet"]), seq_len=16, text_column=column)
    assert says in str(e.value) and "--text-column" in str(e.value)


def test_a_damaged_file_is_one_line(tmp_path):
    bad = tmp_path / "bad.arrow"
    bad.write_bytes(b"not arrow at all" * 20)
    with pytest.raises(ConfigError, match="is not a readable Arrow IPC file"):
        data.load_corpus(str(bad), seq_len=16)
    cut = tmp_path / "cut.parquet"
    pq.write_table(table(), cut)
    cut.write_bytes(cut.read_bytes()[:100])
    with pytest.raises(ConfigError, match="is not a readable Parquet file"):
        data.load_corpus(str(cut), seq_len=16, text_column="content")


def test_what_datasets_writes(tmp_path):
    """save_to_disk's directory (data-00000-of-00001.arrow beside two JSON files) and the
    cache file of Dataset.map are read as they are."""
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_dict({"text": TEXTS})
    ds.save_to_disk(str(tmp_path / "saved"))
    got = data.load_tokens(str(tmp_path / "saved"))[0]
    np.testing.assert_array_equal(got, data.encode("\n".join(TEXTS)))
    cached = ds.map(lambda r: {"text": r["text"].upper()},
                    cache_file_name=str(tmp_path / "cache-upper.arrow"))
    assert cached.cache_files[0]["filename"].endswith("cache-upper.arrow")
    got = data.load_tokens(str(tmp_path / "cache-upper.arrow"))[0]
    np.testing.assert_array_equal(got, data.encode("\n".join(t.upper() for t in TEXTS)))

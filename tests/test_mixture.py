"""Weighted mixtures of data sources (`--data a.txt:0.7,b.parquet:0.3`): each batch splits
its rows by the weights, the rows are the same for every mesh, and a run stopped and resumed
trains on exactly the batches of one that was not."""

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jdist import data
from jdist.data import mixture
from jdist.errors import ConfigError
from jdist.spmd.mesh import build_mesh
from jdist.train.__main__ import main as train_main

LETTERS, DIGITS = b"abcdefghij \n", b"0123456789 \n"


@pytest.fixture
def sources(tmp_path) -> dict[str, str]:
    """Three sources told apart by their bytes: letters (text), digits (Parquet rows) and
    punctuation (text)."""
    rng = np.random.default_rng(0)
    letters = tmp_path / "letters.txt"
    letters.write_bytes(rng.choice(list(LETTERS), 20_000).astype(np.uint8).tobytes())
    rows = [rng.choice(list(DIGITS), 200).astype(np.uint8).tobytes().decode() for _ in range(100)]
    pq.write_table(pa.table({"text": rows}), tmp_path / "digits.parquet")
    (tmp_path / "signs.txt").write_text("+-*/=<>!?" * 1000)
    return {"letters": str(letters), "digits": str(tmp_path / "digits.parquet"),
            "signs": str(tmp_path / "signs.txt")}


def source_of(row: np.ndarray) -> str:
    chars = set(bytes(row.astype(np.uint8).tolist()))
    for name, alphabet in (("letters", LETTERS), ("digits", DIGITS)):
        if chars <= set(alphabet):
            return name
    return "signs"


def test_each_batch_splits_its_rows_by_the_weights(sources):
    spec = f"{sources['letters']}:0.5,{sources['digits']}:0.3,{sources['signs']}:0.2"
    mix = mixture.load(mixture.parse(spec), seq_len=16)
    steps, batch = 400, 16
    seen = {name: [] for name in sources}
    for step in range(steps):
        rows = mix.host_batch(seed=3, step=step, batch_size=batch, seq_len=16)["inputs"]
        names = [source_of(r) for r in rows]
        for name in sources:
            seen[name].append(names.count(name))
    for name, weight in (("letters", 0.5), ("digits", 0.3), ("signs", 0.2)):
        per_batch = np.array(seen[name])
        # As close to batch x weight as whole rows allow, in every batch ...
        assert set(per_batch) <= {int(np.floor(batch * weight)), int(np.ceil(batch * weight))}
        # ... and the weight itself over many (systematic sampling: within 1.5 percent).
        assert abs(per_batch.sum() / (steps * batch) - weight) < 0.015, (name, per_batch.sum())
    # A pure function of (seed, step); the validation stream reads the held-out tails.
    a, b = (mix.host_batch(3, 7, batch, 16) for _ in range(2))
    np.testing.assert_array_equal(a["inputs"], b["inputs"])
    val = mix.host_batch(3, 7, batch, 16, data.VAL_STREAM)
    assert not np.array_equal(a["inputs"], val["inputs"])


@pytest.mark.parametrize("mesh, spec", [("dp=8", P("data")),
                                        ("dp=2,fsdp=2,sp=2", P(("data", "fsdp"), "sequence"))])
def test_mixed_batch_is_identical_for_every_mesh(sources, mesh, spec):
    mix = mixture.load(mixture.parse(f"{sources['letters']}:0.7,{sources['digits']}:0.3"), 32)
    sharding = NamedSharding(build_mesh(mesh), spec)
    batch = mix.global_batch(0, 5, 16, 32, sharding)
    ref = mix.host_batch(0, 5, 16, 32)
    for key in ("inputs", "targets"):
        assert batch[key].sharding == sharding
        np.testing.assert_array_equal(np.asarray(batch[key]), ref[key])


def test_each_process_reads_only_its_rows(sources, monkeypatch):
    # make_array_from_callback asks only for addressable rows; count the rows materialised.
    mix = mixture.load(mixture.parse(f"{sources['letters']}:0.7,{sources['digits']}:0.3"), 32)
    seen, rows = [], mixture.Mixture.rows
    monkeypatch.setattr(mixture.Mixture, "rows",
                        lambda self, s, *a: seen.append(len(s)) or rows(self, s, *a))
    mix.global_batch(0, 0, 16, 32, NamedSharding(build_mesh("dp=8"), P("data")))
    assert sum(seen) == 16 and max(seen) == 2  # eight devices, two rows each, read once


@pytest.mark.parametrize("spec, says", [
    ("a.txt:0.7,b.txt", "--data part 'b.txt' is not PATH:WEIGHT"),
    ("a.txt:0.7,b.txt:-1", "--data part 'b.txt:-1' is not PATH:WEIGHT with a positive weight"),
    ("a.txt:x", "--data part 'a.txt:x' is not PATH:WEIGHT"),
])
def test_a_bad_mixture_is_one_line(spec, says):
    with pytest.raises(ConfigError, match=r"^[^\n]*$") as e:
        mixture.parse(spec)
    assert says in str(e.value) and "--data a.txt:0.7,b.bin:0.3" in str(e.value)


def test_sources_of_different_tokenizations_are_refused(sources, tmp_path):
    (np.arange(4000, dtype=np.uint16) % 300).tofile(tmp_path / "ids.bin")
    parts = mixture.parse(f"{sources['letters']}:1,{tmp_path / 'ids.bin'}:1")
    with pytest.raises(ConfigError, match=r"\(bytes\) and .* \(token ids, eod id None\) are "
                                          "not tokenized alike; pass --tokenizer"):
        mixture.load(parts, 16)
    with pytest.raises(ConfigError, match="chats.jsonl is JSON lines, which would be trained "
                                          "on as raw JSON text; run python -m jdist.data"):
        mixture.load(mixture.parse(f"{sources['letters']}:1,chats.jsonl:1"), 16)


ARGS = ["--model", "tiny", "--batch-size", "8", "--seq-len", "32", "--warmup", "1",
        "--eval-every", "2", "--eval-batches", "1", "--log-every", "1"]


def records(run_dir) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_a_resumed_mixture_run_trains_on_the_same_batches(sources, tmp_path, capsys):
    mix = ["--data", f"{sources['letters']}:0.7,{sources['digits']}:0.3"]
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    assert train_main([*ARGS, *mix, "--mesh", "dp=8", "--steps", "4", "--checkpoint-every", "2",
                       "--run-dir", str(whole)]) == 0
    assert "data: mixture of 70% " in capsys.readouterr().out
    # A run stopped after step 2 resumes from that step's checkpoint.
    assert train_main([*ARGS, *mix, "--mesh", "dp=8", "--steps", "4", "--run-dir", str(cut),
                       "--resume", str(whole / "checkpoints" / "2")]) == 0
    full, resumed = records(whole), records(cut)
    assert [r["step"] for r in resumed] == [3, 4]
    for a, b in zip(full[2:], resumed):
        assert a["loss"] == b["loss"] and a.get("val_loss") == b.get("val_loss")  # bitwise
    # The weights are part of what a run computes: changing them refuses to resume.
    other = ["--data", f"{sources['letters']}:0.5,{sources['digits']}:0.5"]
    assert train_main([*ARGS, *other, "--mesh", "dp=8", "--steps", "6",
                       "--run-dir", str(whole)]) == 2
    (err,) = capsys.readouterr().err.strip().splitlines()
    assert "was written with --data" in err and "pass the same value" in err, err

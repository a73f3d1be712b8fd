"""Supervised fine-tuning data: chat templates rendered as transformers renders them, loss
masks on the answers only, packing into rows, deterministic mesh-independent batches, and
one-line errors for bad input."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jdist import data
from jdist.data import sft
from jdist.data.chat import chat_template
from jdist.data.tokenizer import load_tokenizer
from jdist.errors import ConfigError
from jdist.models.loss import IGNORE

ROOT = Path(__file__).resolve().parents[1]
TOK = ROOT / "tests/fixtures/hf/tokenizer"
MODEL = ROOT / "tests/fixtures/hf/llama-untied"
REF = json.loads((TOK / "reference.json").read_text())
EOD = REF["eos_token_id"]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(str(TOK))


def write_jsonl(path: Path, records: list) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n"
                            for r in records))
    return str(path)


def chat(i: int) -> dict:
    return {"messages": [{"role": "user", "content": f"Square of {i}?"},
                         {"role": "assistant", "content": f"{i * i}"}]}


def mixed(n: int) -> list:
    return [r for i in range(n) for r in
            ({"prompt": f"What is {i} + {i}? ", "completion": f"{2 * i}."}, chat(i))]


def tokenizer_with(tmp_path: Path, name: str, template: str | None) -> Path:
    """The fixture tokenizer with another chat template (None: none)."""
    out = tmp_path / name
    out.mkdir()
    shutil.copy(TOK / "tokenizer.json", out)
    config = json.loads((TOK / "tokenizer_config.json").read_text())
    config.pop("chat_template")
    if template is not None:
        config["chat_template"] = template
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


def test_chat_template_renders_exactly_as_transformers(tok):
    template, ref = chat_template(tok), REF["chat"]
    rendered = sft.render(template, tok, ref["messages"], False)
    assert rendered == ref["rendered"]
    assert tok.encode(rendered).tolist() == ref["ids"]
    prompt = sft.render(template, tok, ref["generation_prompt_messages"], True)
    assert prompt == ref["generation_prompt_rendered"]
    assert tok.encode(prompt).tolist() == ref["generation_prompt_ids"]
    for text, special_id in REF["special_tokens"].items():  # template text -> special ids
        assert tok.encode(text).tolist() == [special_id]


def test_chat_record_counts_the_assistant_turn_and_its_end(tok):
    ref = REF["chat"]
    tokens, targets = sft.document({"messages": ref["messages"]}, "x:1", tok,
                                   chat_template(tok))
    ids, n_prompt = ref["ids"], len(ref["generation_prompt_ids"])
    assert tokens.tolist() == [EOD] + ids  # pieces encode as the whole rendering does
    assert targets.tolist() == [IGNORE] * n_prompt + ids[n_prompt:] + [EOD]
    assert tok.decode(ids[n_prompt:]) == "It is 4.<|eot_id|>"


def test_multi_turn_chat_counts_every_assistant_turn_and_no_user_turn(tok):
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"},
                {"role": "user", "content": "bye"}, {"role": "assistant", "content": "ok"},
                {"role": "user", "content": "!"}]
    tokens, targets = sft.document({"messages": messages}, "x:1", tok, chat_template(tok))
    counted = tokens[1:][targets[:-1] >= 0]
    assert tok.decode(counted) == "yo<|eot_id|>ok<|eot_id|>"
    assert targets[-1] == IGNORE  # ends with a user turn: no answer ends there


def test_prompt_completion_masks(tok):
    p, c = tok.encode("Q: two? ").tolist(), tok.encode("A: 2").tolist()
    tokens, targets = sft.document({"prompt": "Q: two? ", "completion": "A: 2"}, "x:1", tok,
                                   None)
    assert tokens.tolist() == [EOD] + p + c
    assert targets.tolist() == [IGNORE] * len(p) + c + [EOD]
    # A completion that writes the end-of-document token itself ends there.
    _, targets = sft.document({"prompt": "Q", "completion": "A<|end_of_text|>"}, "x:1", tok,
                              None)
    assert targets.tolist()[-2:] == [EOD, IGNORE]


def test_packing_fills_rows_in_order_pads_and_truncates():
    docs = [(np.array([9, 1, 2]), np.array([-1, 2, 9])), (np.array([9, 3]), np.array([3, 9])),
            (np.array([9, 4, 5, 6, 7, 8]), np.array([-1, 5, 6, 7, 8, 9])),
            (np.array([9, 1]), np.array([1, 9]))]
    tokens, targets, truncated = sft.pack(docs, seq_len=5, eod=9)
    assert truncated == 1  # 6 tokens: its closing target does not fit in 5
    assert tokens.tolist() == [[9, 1, 2, 9, 3, 9], [9, 4, 5, 6, 7, 8], [9, 1, 9, 9, 9, 9]]
    assert targets.tolist() == [[-1, 2, 9, 3, 9], [-1, 5, 6, 7, 8], [1, 9, -1, -1, -1]]


def test_load_sft_rows_split_and_summary(tmp_path, tok):
    path = write_jsonl(tmp_path / "d.jsonl", mixed(30) + [{"prompt": "x" * 200,
                                                          "completion": "y"}])
    rows = sft.load_sft(path, tok, seq_len=64)
    n = len(rows.train.tokens) + len(rows.val.tokens)
    assert len(rows.val.tokens) == max(1, int(n * 0.05)) and rows.truncated == 1
    assert rows.records == 61
    for part in (rows.train, rows.val):
        assert part.tokens.dtype == part.targets.dtype == np.int32
        assert part.tokens.shape[1] == 65 and part.targets.shape[1] == 64
        counted = part.targets >= 0  # every counted target is the next token
        np.testing.assert_array_equal(part.targets[counted], part.tokens[:, 1:][counted])
        assert (part.tokens[:, 0] == EOD).all()
    assert rows.counted == sum(int((p.targets >= 0).sum()) for p in (rows.train, rows.val))
    assert rows.summary().endswith(f"61 records in {len(rows.train.tokens)} train / "
                                   f"{len(rows.val.tokens)} val rows, {rows.counted:,} counted "
                                   "tokens, 1 truncated (longer than a row)")
    corpus = rows.corpus()
    assert len(corpus.train) == rows.train.tokens.size and corpus.eod_id == EOD
    assert len(data.fingerprint(corpus)) == 16


def test_batches_are_the_same_rows_for_every_sharding():
    rows = sft.SftRows(np.arange(11 * 9, dtype=np.int32).reshape(11, 9),
                       np.arange(11 * 8, dtype=np.int32).reshape(11, 8) - 3)
    want = sft.host_sft_batch(rows, seed=3, step=5, batch_size=8)
    np.testing.assert_array_equal(want["inputs"], rows.tokens[:, :-1][
        sft.row_indices(11, 3, 5, 8)])
    devices = np.array(jax.devices()[:8])
    for shape, spec in [((8,), PartitionSpec()), ((8,), PartitionSpec("a")),
                        ((2, 4), PartitionSpec("a", "b")), ((4, 2), PartitionSpec(None, "b"))]:
        mesh = Mesh(devices.reshape(shape), ("a", "b")[: len(shape)])
        got = sft.sft_batch(rows, 3, 5, 8, NamedSharding(mesh, spec))
        for key in ("inputs", "targets"):
            np.testing.assert_array_equal(np.asarray(got[key]), want[key])


def test_each_epoch_sees_every_row_once():
    n, batch = 7, 3
    seen = np.concatenate([sft.row_indices(n, 0, s, batch) for s in range(14)])
    epochs = seen.reshape(6, n)
    assert all(sorted(e) == list(range(n)) for e in epochs)
    assert len({tuple(e) for e in epochs}) > 1  # a new order every epoch
    np.testing.assert_array_equal(sft.row_indices(n, 0, 4, batch), seen[12:15])  # pure
    assert not np.array_equal(sft.row_indices(n, 0, 0, n), sft.row_indices(n, 0, 0, n, 1))


@pytest.mark.parametrize("line, match", [
    ('{"text": "hi"}', r"d\.jsonl:2 has neither \"prompt\" and \"completion\" nor"),
    ('{"prompt": "hi"', r"d\.jsonl:2 is not valid JSON"),
    ('{"prompt": "hi", "completion": 3}', r"d\.jsonl:2: prompt, completion .* strings"),
    ('{"messages": [{"role": "user", "content": "hi"}]}', r"d\.jsonl:2 has no message with"),
    ('{"prompt": "a<|end_of_text|>b", "completion": "c"}', r"d\.jsonl:2 holds the end-of-doc"),
])
def test_bad_records_are_named_by_file_and_line(tmp_path, tok, line, match):
    path = write_jsonl(tmp_path / "d.jsonl", [mixed(1)[0], line] + mixed(20))
    with pytest.raises(ConfigError, match=match):
        sft.load_sft(path, tok, seq_len=64)


def test_chat_records_need_a_prefix_stable_template(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", mixed(20))
    bare = load_tokenizer(str(tokenizer_with(tmp_path, "bare", None)))
    with pytest.raises(ConfigError, match=r"d\.jsonl:2 is a chat record but .* no chat templ"):
        sft.load_sft(path, bare, seq_len=64)
    counting = "{{ messages | length }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    odd = load_tokenizer(str(tokenizer_with(tmp_path, "odd", counting)))
    with pytest.raises(ConfigError, match=r"d\.jsonl:2: the chat template is not prefix-stab"):
        sft.load_sft(path, odd, seq_len=64)


def test_too_few_rows_says_how_many_records(tmp_path, tok):
    path = write_jsonl(tmp_path / "d.jsonl", mixed(1))
    with pytest.raises(ConfigError, match="2 records fill 1 row .* at least 4 records"):
        sft.load_sft(path, tok, seq_len=64)


def sft_config(**flags):
    from jdist.config import TrainConfig

    return TrainConfig.of(**{"model": "tiny", "mesh": "dp=1", "vocab_size": 384, "seq_len": 64,
                             "batch_size": 4, "data_format": "sft", **flags})


def test_prepare_loads_rows_and_implies_document_packing(tmp_path, tok, capsys):
    from jdist.train.resume import RESULT_FLAGS
    from jdist.train.setup import prepare

    path = write_jsonl(tmp_path / "d.jsonl", mixed(30))
    setup = prepare(sft_config(data=path, tokenizer=str(TOK)))
    assert "60 records in" in capsys.readouterr().out
    assert setup.plan.compute.eod_id == EOD and setup.rows is not None
    for stream, part in ((data.TRAIN_STREAM, setup.rows.train), (data.VAL_STREAM,
                                                                 setup.rows.val)):
        want = sft.host_sft_batch(part, 0, 2, 4, stream)
        got = setup.batch(2, stream)
        for key in ("inputs", "targets"):
            np.testing.assert_array_equal(np.asarray(got[key]), want[key])
    assert "data_format" in RESULT_FLAGS
    with pytest.raises(ConfigError, match="--data-format sft reads a .jsonl"):
        prepare(sft_config(data=str(tmp_path / "d.txt"), tokenizer=str(TOK)))
    with pytest.raises(ConfigError, match="--data-format sft needs --tokenizer"):
        prepare(sft_config(data=path))


def test_cli_error_is_one_line_and_writes_nothing(tmp_path, train_refusal):
    path = write_jsonl(tmp_path / "d.jsonl", mixed(30))
    assert train_refusal(["--model", "tiny", "--mesh", "dp=1", "--data", path, "--data-format",
                          "sft", "--run-dir", tmp_path / "run"]) == (
        "jdist: error: --data-format sft needs --tokenizer (a Hugging Face tokenizer directory,"
        " with its chat template for messages records)")
    assert not (tmp_path / "run").exists()


def test_cli_trains_on_sft_records(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", mixed(40))
    result = subprocess.run(
        [sys.executable, "-m", "jdist.train", "--init-from", str(MODEL), "--tokenizer",
         str(MODEL), "--data", path, "--data-format", "sft", "--seq-len", "64",
         "--batch-size", "4", "--steps", "3", "--mesh", "dp=2", "--eval-every", "0",
         "--run-dir", str(tmp_path / "run")],
        capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "80 records in" in result.stdout
    losses = [json.loads(line)["loss"] for line in
              (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 3 and np.isfinite(losses).all()


def test_resume_fingerprint_covers_the_loss_masks(tmp_path, tok):
    """Two files of the same tokens that count different ones are different data: a run
    resumed on the other would train on other targets, so its fingerprint differs."""
    prompts = [(f"What is {i} + {i}?", f"{2 * i}.") for i in range(40)]
    # The space after "?" ends the prompt (not counted) in one file, opens the answer in
    # the other; either way it is the same token.
    uncounted = write_jsonl(tmp_path / "a.jsonl", [{"prompt": q + " ", "completion": a}
                                                   for q, a in prompts])
    counted = write_jsonl(tmp_path / "b.jsonl", [{"prompt": q, "completion": " " + a}
                                                 for q, a in prompts])
    a, b = (sft.load_sft(path, tok, 32).corpus() for path in (uncounted, counted))
    np.testing.assert_array_equal(a.train, b.train)
    np.testing.assert_array_equal(a.val, b.val)
    assert data.fingerprint(a) != data.fingerprint(b)
    assert data.fingerprint(a) == data.fingerprint(sft.load_sft(uncounted, tok, 32).corpus())


# ------------------------------------------------------ a model whose eos closes each turn

def test_a_chat_whose_eos_ends_each_turn_trains_every_answer_and_its_end(smollm2_tokenizer):
    from jdist.data.packing import document_layout

    tok = load_tokenizer(str(smollm2_tokenizer))
    template = chat_template(tok)
    im_end, endoftext = tok.token_id("<|im_end|>"), tok.token_id("<|endoftext|>")
    assert tok.eod_id == im_end and endoftext == 0
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"},
                {"role": "user", "content": "bye"}, {"role": "assistant", "content": "ok"}]
    tokens, targets = sft.document({"messages": messages}, "x:1", tok, template)
    ids = tokens[1:]
    assert tokens[0] == endoftext  # documents are separated by another end-of-text token
    assert ids.tolist() == tok.encode(sft.render(template, tok, messages, False)).tolist()
    counted = ids[targets[:-1] >= 0]
    assert tok.decode(counted) == "yo<|im_end|>ok<|im_end|>"  # not the "\n" after either
    assert targets[-1] == IGNORE  # the last answer's end is its own <|im_end|>
    np.testing.assert_array_equal(targets[:-1][targets[:-1] >= 0], counted)
    segments, _ = document_layout(jax.numpy.asarray(tokens[None]), endoftext)
    assert set(np.asarray(segments)[0].tolist()) == {1}  # one conversation, one document


def test_cli_trains_on_a_chat_whose_eos_ends_each_turn(tmp_path, smollm2_tokenizer):
    records = [{"messages": [{"role": "user", "content": f"Square of {i}?"},
                             {"role": "assistant", "content": f"{i * i}"}]} for i in range(40)]
    path = write_jsonl(tmp_path / "chat.jsonl", records)
    result = subprocess.run(
        [sys.executable, "-m", "jdist.train", "--model", "tiny", "--vocab-size", "384",
         "--tokenizer", str(smollm2_tokenizer), "--data", path, "--data-format", "sft", "--seq-len",
         "128", "--batch-size", "4", "--steps", "2", "--mesh", "dp=1", "--eval-every", "0",
         "--run-dir", str(tmp_path / "run")],
        capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "40 records in" in result.stdout
    assert "documents are separated by <|endoftext|> (id 0)" in result.stdout


# ------------------------------------------------- --init-from brings its own tokenizer


def test_init_from_reads_text_with_the_models_own_tokenizer(tmp_path):
    from jdist.config import TrainConfig
    from jdist.train.setup import prepare

    path = write_jsonl(tmp_path / "d.jsonl", mixed(30))
    setup = prepare(TrainConfig.of(init_from=str(MODEL), mesh="dp=1", seq_len=64,
                                   batch_size=4, data=path, data_format="sft"))
    assert setup.config.data.tokenizer == str(MODEL)  # recorded: generate and export find it
    assert setup.plan.compute.eod_id == EOD
    result = subprocess.run(
        [sys.executable, "-m", "jdist.train", "--init-from", str(MODEL), "--tokenizer", "bytes",
         "--steps", "1", "--run-dir", str(tmp_path / "run")],
        capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 2 and not (tmp_path / "run").exists()
    assert result.stderr.strip().splitlines() == [
        f"jdist: error: --tokenizer bytes has 256 tokens but the model's own tokenizer "
        f"(--init-from {MODEL}) has 320; drop --tokenizer to use the model's own"]


# ----------------------------------------------------------------- records cut by --seq-len


def test_records_longer_than_a_row_are_refused_past_5_percent(tmp_path, capsys):
    from jdist.data import truncation
    from jdist.train.setup import prepare

    long = [{"prompt": f"{'x' * (40 + i)} {i}? ", "completion": "y"} for i in range(10)]
    path = write_jsonl(tmp_path / "d.jsonl", mixed(30) + long)
    lengths = sft.load_sft(path, load_tokenizer(str(TOK)), 64).lengths
    assert truncation.seq_len_for(lengths, 1.0) == -(-lengths.max() // 64) * 64
    with pytest.raises(ConfigError) as e:
        prepare(sft_config(data=path, tokenizer=str(TOK), seq_len=32))
    cut = int((lengths > 32).sum())
    assert str(e.value) == (
        f"{cut} of 70 sft records ({cut / 70:.1%}) are longer than --seq-len 32 and are cut, "
        f"losing the ends of their answers; --seq-len {truncation.seq_len_for(lengths, 0.95)} "
        f"fits 95% of them, {truncation.seq_len_for(lengths, 1.0)} all; pass one of those, or "
        "--allow-truncation to train on the cut records")
    prepare(sft_config(data=path, tokenizer=str(TOK), seq_len=32, allow_truncation=True))
    assert f"jdist: warning: {cut} of 70 sft records" in capsys.readouterr().err
    fits = truncation.seq_len_for(lengths, 0.95)
    prepare(sft_config(data=path, tokenizer=str(TOK), seq_len=fits))
    assert (lengths > fits).mean() <= 0.05

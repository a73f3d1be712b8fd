"""Generation with a KV cache (`jdist.generate`): cached decoding computes what the full
forward computes, on one device and on tp=2, for ragged batches, and greedy decoding matches
`transformers`; the cache is as big as `cache_bytes` says; the CLI runs end to end."""

import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jdist import data
from jdist.generate import cache_bytes, generate, init_cache, left_pad
from jdist.generate.sample import Sampling, nucleus
from jdist.generate.weights import find_checkpoint, inference_plan, restore_params
from jdist.hf.config import model_config
from jdist.hf.load import load_params
from jdist.models import get_preset
from jdist.spmd.mesh import build_mesh
from jdist.step.state import build_model

TINY = get_preset("tiny")
NEW = 8
PROMPT = data.encode("def f(x):").astype(np.int32)
FIXTURES = Path(__file__).parent / "fixtures" / "hf"


@pytest.fixture(autouse=True)
def highest_precision():
    with jax.default_matmul_precision("highest"):
        yield


def mesh_of(text: str, n: int):
    return build_mesh(text, jax.devices()[:n])


@pytest.fixture(scope="module")
def model():
    """Random weights 20x the initial scale (std 0.4, like the HF fixtures' 0.5): at the
    initial 0.02, attention barely moves the logits and a wrong mask would go unseen."""
    model = build_model(TINY, 0)
    state = nnx.state(model)
    nnx.update(model, jax.tree.map(lambda x: x * 20 if x.ndim > 1 else x, state))
    return model


@pytest.fixture(scope="module")
def params(model):
    return nnx.to_pure_dict(nnx.state(model))


@pytest.fixture(scope="module")
def greedy(params):
    """One device, greedy, float32: PROMPT's NEW tokens."""
    return generate(params, TINY, [PROMPT], NEW)[0]


def full_forward_greedy(model, prompt: np.ndarray, n: int) -> list[int]:
    """Greedy decoding by recomputing `Llama.__call__` over the whole sequence for every
    token. The sequence is right-padded to its final length so that one compile serves
    every step: attention is causal, so the logits at position i see tokens 0..i only (the
    padding is never attended to), and the last step is the unpadded sequence itself."""
    forward = jax.jit(lambda tokens: model(tokens))
    seq = list(prompt)
    for _ in range(n):
        padded = np.zeros((1, len(prompt) + n - 1), np.int32)
        padded[0, :len(seq)] = seq
        seq.append(int(jnp.argmax(forward(padded)[0, len(seq) - 1])))
    return seq[len(prompt):]


def test_cached_greedy_equals_the_full_forward(model, greedy):
    assert greedy.tolist() == full_forward_greedy(model, PROMPT, NEW)


def test_tensor_parallel_generates_the_same_tokens(params, greedy):
    plan = inference_plan(TINY, mesh_of("tp=2", 2))
    sharded = jax.device_put(params, plan.shardings.params)
    assert generate(sharded, TINY, [PROMPT], NEW)[0].tolist() == greedy.tolist()


def test_ragged_batch_equals_each_prompt_alone(params, greedy):
    rng = np.random.default_rng(0)
    short, long = (rng.integers(0, 256, n).astype(np.int32) for n in (3, 14))
    batch = generate(params, TINY, [short, PROMPT, long], NEW)
    assert batch[1].tolist() == greedy.tolist()
    for prompt, got in ((short, batch[0]), (long, batch[2])):
        assert got.tolist() == generate(params, TINY, [prompt], NEW)[0].tolist()


@pytest.mark.parametrize("capacity", [None, 1], ids=["replicated", "sharded"])
def test_fsdp_generates_the_same_tokens(params, greedy, capacity):
    """Over fsdp=2 the weights are replicated when a device holds them (the default here),
    else sharded as training shards them; either way one prompt (a batch fsdp cannot split,
    filled up with a copy) decodes to the one-device tokens."""
    from jdist.generate.placement import generation_rules

    mesh = mesh_of("fsdp=2", 2)
    rules, said = generation_rules(TINY, mesh, jnp.float32, capacity=capacity)
    assert said.startswith("weights replicated" if capacity is None else "weights stay sharded")
    sharded = jax.device_put(params, inference_plan(TINY, mesh, rules).shardings.params)
    embed = sharded["embed"]
    assert embed.addressable_shards[0].data.shape[1] == TINY.d_model // (1 if capacity is None
                                                                          else 2)
    assert generate(sharded, TINY, [PROMPT], NEW, rules=rules)[0].tolist() == greedy.tolist()


def test_cache_bytes_and_sharding():
    tokens, start = left_pad([PROMPT, PROMPT[:4]], multiple=4)
    assert tokens.shape == (2, 12) and start.tolist() == [12 - len(PROMPT), 8]
    assert tokens[1, 8:].tolist() == PROMPT[:4].tolist() and not tokens[1, :8].any()
    mesh = mesh_of("tp=2", 2)
    cache = init_cache(TINY, start, 40, jnp.float32, mesh)
    assert sum(x.nbytes for x in jax.tree.leaves(cache)) == cache_bytes(TINY, 2, 40, jnp.float32)
    assert cache.keys.shape == (TINY.n_layers, 2, 40, TINY.n_kv_heads, TINY.dim_per_head)
    # kv heads over tensor, by the training rules: each device holds half of them
    shard = cache.keys.addressable_shards[0].data
    assert shard.shape[3] == TINY.n_kv_heads // 2 and cache.values.sharding == cache.keys.sharding
    assert cache_bytes(TINY, 2, 40, jnp.bfloat16) == 2 * (2 * 2 * 40 * 4 * 8) * 2 + 4 + 8


def test_nucleus_keeps_the_smallest_set_reaching_top_p():
    logits = jnp.log(jnp.array([[0.1, 0.5, 0.15, 0.25]]))
    kept = np.isfinite(np.asarray(nucleus(logits, 0.7)))[0]
    assert kept.tolist() == [False, True, False, True]
    assert np.isfinite(np.asarray(nucleus(logits, 0.01)))[0].tolist() == [False, True, False,
                                                                           False]


def test_sampling_is_reproducible_from_the_seed(params):
    sampled = lambda seed: generate(params, TINY, [PROMPT], NEW, seed=seed,
                                    sampling=Sampling(temperature=1.0, top_p=0.9))[0].tolist()
    assert sampled(3) == sampled(3)


@pytest.mark.parametrize("name, mesh, n", [("llama-untied", "", 1), ("llama-tied", "", 1),
                                           ("llama-untied", "tp=2", 2), ("qwen3", "", 1),
                                           ("qwen3", "tp=2", 2), ("mixtral", "", 1),
                                           ("qwen3-moe", "tp=2", 2), ("qwen3-moe", "ep=2", 2),
                                           ("mixtral", "ep=2,tp=2", 4)])
def test_greedy_matches_transformers(name, mesh, n):
    """`reference.npz`: transformers' `generate(max_new_tokens=32, do_sample=False)`."""
    ref = np.load(FIXTURES / name / "reference.npz")
    cfg = model_config(FIXTURES / name)
    params = load_params(FIXTURES / name, inference_plan(cfg, mesh_of(mesh, n)))
    new = ref["greedy_ids"].shape[1]
    out = generate(params, cfg, list(ref["prompt_ids"]), new)
    np.testing.assert_array_equal(np.stack(out), ref["greedy_ids"])


# --------------------------------------------------------------------------------- CLI


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A checkpoint of a 2-step `python -m jdist.train` run (in this process: same code)."""
    from jdist.train.__main__ import main

    root = tmp_path_factory.mktemp("generate")
    text = root / "corpus.txt"
    text.write_bytes(data.builtin_text(1 << 15))
    argv = ["--model", "tiny", "--steps", "2", "--checkpoint-every", "2", "--mesh", "dp=1",
            "--batch-size", "2", "--seq-len", "32", "--eval-every", "0", "--data", str(text),
            "--run-dir", str(root / "run")]
    assert main(argv) == 0
    return root / "run"


def generate_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "jdist.generate", *args], check=False,
                          capture_output=True, text=True, timeout=300)


@pytest.fixture
def generate_main(capfd):
    """The command's `main` in this process, its output read at the file descriptors (a new
    interpreter costs ~3 s importing jax); test_bad_input_exits_2_from_the_command_line and
    the chat test run the process itself."""
    from jdist.generate.__main__ import main

    def run(*args: str) -> subprocess.CompletedProcess:
        capfd.readouterr()
        code = main(list(args))
        return subprocess.CompletedProcess(args, code, *capfd.readouterr())

    return run


def test_cli_generates_from_a_training_checkpoint(run_dir, generate_main):
    result = generate_main("--checkpoint", str(run_dir), "--prompt", data.decode(PROMPT),
                          "--mesh", "tp=2", "--max-new-tokens", str(NEW))
    assert result.returncode == 0, result.stderr
    assert "restored parameters of step 2" in result.stderr and "tokens/s" in result.stderr
    found = find_checkpoint(str(run_dir))
    params = restore_params(found, inference_plan(TINY, mesh_of("", 1)))
    ids = generate(params, TINY, [PROMPT], NEW)[0]
    assert result.stdout == data.decode(PROMPT) + data.decode(ids) + "\n"


@pytest.mark.parametrize("args, message", [
    (["--prompt", "x"], "give exactly one of --checkpoint CKPT and --init-from HF_DIR"),
    (["--checkpoint", "RUN", "--init-from", "HF", "--prompt", "x"], "give exactly one of"),
    (["--checkpoint", "RUN", "--prompt", "x", "--top-p", "0"], "--top-p 0.0 must be in (0, 1]"),
    (["--checkpoint", "RUN", "--prompt", "x", "--top-p", "1.5"], "--top-p 1.5 must be in"),
    (["--checkpoint", "RUN", "--prompt", "x" * 12, "--max-context", "16"],
     "prompt 0 has 12 tokens, which with --max-new-tokens 64 exceeds the model's context of 16"),
    (["--checkpoint", "RUN", "--prompt", "x", "--mesh", "pp=2"],
     "generation shards over data, fsdp, tensor, expert only, not stage"),
    (["--checkpoint", "RUN", "--prompt", "x", "--chat"],
     "--chat needs a chat template, which tokenizer bytes has not"),
])
def test_bad_input_is_one_line_and_exit_2(run_dir, args, message, capsys):
    from jdist.generate.__main__ import main

    assert main([str(run_dir) if a == "RUN" else a for a in args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("jdist: error: ") and message in err[0], err


def test_bad_input_exits_2_from_the_command_line(tmp_path):
    result = generate_cli("--checkpoint", str(tmp_path / "missing"), "--prompt", "x")
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.strip().splitlines() == [
        f"jdist: error: --checkpoint {tmp_path / 'missing'}: no such checkpoint; pass an "
        "existing checkpoint directory"]


@pytest.mark.parametrize("adds_bos", [True, False], ids=["template-adds-bos",
                                                         "bos-named-not-added"])
def test_prompts_are_encoded_as_transformers_does(tmp_path, adds_bos):
    """A prompt gets the special tokens the tokenizer's post-processor adds, as
    `transformers`' `tokenizer(text)` does (`reference.json`'s `ids_with_special_tokens`
    were written by it): bos where the template prepends it; nothing where the tokenizer
    names a bos token (tokenizer_config.json) but its post-processor does not add it."""
    import json
    import shutil

    from tokenizers import Tokenizer, processors

    from jdist.data.tokenizer import load_tokenizer
    from jdist.generate.text import encode_prompts

    src = FIXTURES / "tokenizer"
    ref = json.loads((src / "reference.json").read_text())
    tok = Tokenizer.from_file(str(src / "tokenizer.json"))
    bos = ref["bos_token"]
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", special_tokens=[(bos, ref["bos_token_id"])]) if adds_bos \
        else processors.ByteLevel(trim_offsets=False)
    tok.save(str(tmp_path / "tokenizer.json"))
    shutil.copy(src / "tokenizer_config.json", tmp_path)  # names bos_token in both cases
    loaded = load_tokenizer(str(tmp_path))
    assert loaded.bos_id == ref["bos_token_id"]
    texts = [s["text"] for s in ref["samples"] if s["text"]]
    got = encode_prompts(loaded, texts, ref["vocab_size"], 4096, 1)
    key = "ids_with_special_tokens" if adds_bos else "ids"
    want = [s[key] for s in ref["samples"] if s["text"]]
    assert [g.tolist() for g in got] == want


def test_export_carries_the_tokenizer(run_dir, tmp_path, capsys):
    """`jdist.export` writes the tokenizer the run trained with (bytes, as an equivalent HF
    tokenizer that jdist reads back as bytes), so `generate --init-from` the export runs and
    writes what `--checkpoint` writes."""
    from jdist.data.tokenizer import ByteTokenizer, load_tokenizer
    from jdist.export import main as export
    from jdist.generate.__main__ import main as generate_main

    out = tmp_path / "hf"
    assert export([str(run_dir), "--hf", str(out)]) == 0
    assert isinstance(load_tokenizer(str(out)), ByteTokenizer)
    args = ["--prompt", data.decode(PROMPT), "--max-new-tokens", str(NEW)]
    capsys.readouterr()
    assert generate_main(["--checkpoint", str(run_dir), *args]) == 0
    from_checkpoint = capsys.readouterr().out
    assert generate_main(["--init-from", str(out), *args]) == 0
    assert capsys.readouterr().out == from_checkpoint


def test_fsdp_cli_writes_what_one_device_writes(run_dir, generate_main):
    """`--mesh fsdp=2` with one prompt: it used to stop after printing the prompt."""
    result = generate_main("--checkpoint", str(run_dir), "--prompt", data.decode(PROMPT),
                          "--mesh", "fsdp=2", "--max-new-tokens", str(NEW))
    assert result.returncode == 0, result.stderr
    assert "weights replicated over fsdp" in result.stderr
    params = restore_params(find_checkpoint(str(run_dir)), inference_plan(TINY, mesh_of("", 1)))
    ids = generate(params, TINY, [PROMPT], NEW)[0]
    assert result.stdout == data.decode(PROMPT) + data.decode(ids) + "\n"


def padded_head(tmp_path: Path) -> Path:
    """llama-untied (384 ids; its tokenizer has 320) whose head makes a padded id the most
    likely whatever the hidden state h: rows 320+k and 352+k are +-1000 on dimension k, so
    one of them scores 1000 * max_k |h_k|."""
    import shutil

    from safetensors.numpy import load_file, save_file

    out = tmp_path / "padded"
    shutil.copytree(FIXTURES / "llama-untied", out)
    shard = out / "model-00006-of-00006.safetensors"
    tensors = load_file(shard)
    head, k = tensors["lm_head.weight"], np.arange(32)
    head[320:] = 0
    head[320 + k, k], head[352 + k, k] = 1000.0, -1000.0
    save_file(tensors, shard, metadata={"format": "pt"})
    return out


def test_a_padded_vocabulary_never_generates_an_id_past_the_tokenizer(tmp_path, capsys):
    from jdist.data.tokenizer import load_tokenizer
    from jdist.generate.__main__ import main as generate_main

    hf = padded_head(tmp_path)
    cfg, tok = model_config(hf), load_tokenizer(str(hf))
    assert (cfg.vocab_size, tok.vocab_size) == (384, 320)
    params = load_params(hf, inference_plan(cfg, mesh_of("", 1)))
    prompt = tok.encode_prompt("def f(x):").astype(np.int32)
    assert (generate(params, cfg, [prompt], 4)[0] >= 320).all()  # unmasked: padding wins
    for sampling in (Sampling(valid_ids=320), Sampling(1.0, 1.0, 320), Sampling(5.0, 0.9, 320)):
        out = generate(params, cfg, [prompt, prompt], 16, sampling=sampling)
        assert all((ids < 320).all() for ids in out), sampling
    for extra in ([], ["--temperature", "5"]):
        assert generate_main(["--init-from", str(hf), "--prompt", "def f(x):",
                              "--max-new-tokens", "16", *extra]) == 0
        out, err = capsys.readouterr()
        assert out.startswith("def f(x):") and "ids 320-383 are never generated" in err


def test_chat_answers_a_message_from_stdin_in_the_tokenizers_template(tmp_path,
                                                                      smollm2_tokenizer):
    """`--chat`: the message (here on stdin) is a user's turn of the tokenizer's chat template,
    ready for the answer, as transformers' `apply_chat_template(add_generation_prompt=True)`
    renders it; stdout is the answer alone, which ends at the token closing the turn
    (SmolLM2's <|im_end|>, also its eos; Llama 3's <|eot_id|>, not its eos)."""
    import shutil

    from jdist.data.chat import chat_template, render
    from jdist.data.tokenizer import load_tokenizer
    from jdist.generate.text import chat_prompts, complete

    hf = tmp_path / "smol"
    shutil.copytree(FIXTURES / "llama-untied", hf)
    (hf / "special_tokens_map.json").unlink()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smollm2_tokenizer / name, hf / name)
    message = "What is 2 + 2?"
    result = subprocess.run([sys.executable, "-m", "jdist.generate", "--init-from", str(hf),
                             "--chat", "--max-new-tokens", "12"], input=message + "\n",
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    tok = load_tokenizer(str(hf))
    text = render(chat_template(tok), tok, [{"role": "user", "content": message}], True)
    assert text == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained "
                    "by Hugging Face<|im_end|>\n<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n"
                    "<|im_start|>assistant\n")
    cfg = model_config(hf)
    params = load_params(hf, inference_plan(cfg, mesh_of("", 1)))
    ids = generate(params, cfg, [tok.encode(text).astype(np.int32)], 12,
                   sampling=Sampling(valid_ids=tok.vocab_size))[0].tolist()
    end = tok.token_id("<|im_end|>")
    assert result.stdout == tok.decode(ids[:ids.index(end)] if end in ids else ids) + "\n"
    _, stops = chat_prompts(tok, [message])
    assert stops == {end}
    llama3 = load_tokenizer(str(FIXTURES / "tokenizer"))
    _, stops = chat_prompts(llama3, ["hi"])
    assert stops == {llama3.eod_id, llama3.token_id("<|eot_id|>")}
    # each prompt's answer ends at the first of them, which is not printed
    steps = [np.array([5, 7]), np.array([319, 9]), np.array([4, 316]), np.array([8, 8])]
    assert complete(iter(steps), 2, stops) == [[5], [7, 9]]

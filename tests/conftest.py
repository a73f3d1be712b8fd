"""Tests run on 8 simulated CPU devices (set before JAX initialises its backends)."""

import os
import shutil
import tempfile
from pathlib import Path

# Compiling dominates the suite (a tiny step compiles in ~4-7 s and runs in ~50 ms), and
# LLVM's optimisation of the CPU kernels is most of a compile: skip it (the HLO passes,
# and so fusion, partitioning and every collective, are unchanged). Subprocesses inherit it.
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_backend_optimization_level=0"
                           + " --xla_llvm_disable_expensive_passes=true").strip()
# Many tests compile the same programs (the tiny model's step on a layout, in-process and in
# the CLI's subprocesses, again on resume): a compilation cache this session's processes
# share (xdist's workers and their subprocesses inherit the controller's environment)
# returns the same executables without compiling again (the suite: 22.8 min where it took
# about 26). Nothing tested reads it. The GPU target's compile-only programs are written
# but cannot be read back (jax 0.10.2: a warning, then an ordinary compile). The session
# that made the cache removes it (CI's disk also holds two installs of the CUDA plugin).
_CACHE = os.path.join(tempfile.gettempdir(), f"jdist-tests-xla-cache-{os.getpid()}")
_OWN_CACHE = "JAX_COMPILATION_CACHE_DIR" not in os.environ
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", _CACHE)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")
import jax

jax.config.update("jax_num_cpu_devices", 8)
# Backends up now, in every process the suite imports this in: a CLI `main` run in a test's
# process calls configure_devices(n), which before this would change the worker's device
# count for every later test (a test-order-dependent "needs 8 devices but 4 are available").
jax.devices()

import pytest

from jdist import data
from jdist.runtime import target

# `pip install -e ".[dev]"` has no CUDA plugin: there the GPU compiler's tests skip with the
# extra to install. CI installs it and sets this, so a missing plugin fails the run instead.
REQUIRE_CUDA_PLUGIN = os.environ.get("JDIST_REQUIRE_CUDA_PLUGIN") == "1"


# The fast tier (`python -m pytest -m "not slow"`) leaves out what tests/slow.txt lists: a
# file, a test function with all its parameters, or one parameter set (`f.py::test[id]`), as
# `--durations=0` measured them
# (tests/test_tiers.py keeps every entry naming a real test). One list rather than markers
# spread over 60 files: the tiers are re-cut from one measurement.
SLOW_LIST = Path(__file__).with_name("slow.txt")


def slow_entries(text: str) -> set[str]:
    return {line.split("#")[0].strip() for line in text.splitlines()} - {""}


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(config, items):
    slow = slow_entries(SLOW_LIST.read_text())
    for item in items:
        name = item.path.name
        function = f"{name}::{getattr(item, 'originalname', item.name)}"
        if slow & {name, function, f"{name}::{item.name}"}:
            item.add_marker(pytest.mark.slow)
    if target.plugin_installed() or REQUIRE_CUDA_PLUGIN:
        return
    skip = pytest.mark.skip(reason="compiles for a GPU target, which needs jax's CUDA plugin: "
                                   f"{target.CUDA_EXTRA}")
    for item in items:
        if item.get_closest_marker("gpu_compiler"):
            item.add_marker(skip)


def pytest_unconfigure(config):
    if _OWN_CACHE and not hasattr(config, "workerinput"):  # the controller, not a worker
        shutil.rmtree(_CACHE, ignore_errors=True)


@pytest.fixture(scope="session")
def corpus() -> data.Corpus:
    """The builtin corpus (Python stdlib source), loaded once per test session."""
    return data.load_corpus(None, seq_len=128)


@pytest.fixture(scope="session")
def single_device(corpus):
    """`single_device(model, **settings)`: the one-device run of the equivalence harness
    (jdist.tools.equivalence.train_steps on dp=1), computed once per test session and shared by
    every test that compares a layout against it. The reference computes the plain way:
    dense (xla) attention and the loss from full logits, unless `settings` say otherwise,
    so every layout's flash blocks, chunked loss and sharded embedding are checked too."""
    from jdist.config import locate
    from jdist.tools.equivalence import config, train_steps

    cache: dict = {}

    def run(model, **settings):
        settings = {"attention": "xla", "loss": "full", **settings}
        key = (model, tuple(sorted(settings.items())))
        if key not in cache:
            # Flags make the run's config; the rest (batch_fn, grads_step, ...) are
            # train_steps' own arguments.
            flags = {k: v for k, v in settings.items() if k in locate()}
            rest = {k: v for k, v in settings.items() if k not in flags}
            cache[key] = train_steps(model, "dp=1", corpus.train, config(**flags), **rest)
        return cache[key]

    return run


@pytest.fixture
def train_refusal(capfd):
    """`train_refusal(argv)`: what `python -m jdist.train argv` refuses, run in this process
    (`main`, its output read at the file descriptors; a new interpreter for each costs 2 s
    of suite time, importing jax): exit status 2, one line on stderr, no traceback; returns
    the line. tests/test_cli.py checks the whole process on a few."""
    from jdist.train.__main__ import main

    def refuse(argv) -> str:
        code = main([str(a) for a in argv])
        out, err = capfd.readouterr()
        lines = err.strip().splitlines()
        assert code == 2 and len(lines) == 1, (code, out + err)
        assert jax.device_count() == 8, "main changed this process's devices"
        assert lines[0].startswith("jdist: error: ") and "Traceback" not in out, out + err
        return lines[0]

    return refuse


# SmolLM2-Instruct's chat template (ChatML with a default system message).
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}")


@pytest.fixture(scope="session")
def smollm2_tokenizer(tmp_path_factory):
    """A tokenizer directory laid out as SmolLM2-Instruct's, whose eos (<|im_end|>) also
    closes every chat turn: byte-level BPE trained here on the stdlib's text, <|endoftext|>
    id 0, <|im_start|> (its bos) and <|im_end|> special (ids 300, 301: the HF fixtures'
    384-id models can run it), and its chat template. No network."""
    import json

    from tokenizers import AddedToken, Tokenizer

    from jdist.data.tokenizer import train_bpe

    out = tmp_path_factory.mktemp("smollm2")
    text = data.builtin_text(1 << 16).decode("utf-8", "replace").splitlines()
    path = train_bpe(text, 300, out, eod="<|endoftext|>")
    tok = Tokenizer.from_file(str(path))
    tok.add_special_tokens([AddedToken(t, special=True) for t in ("<|im_start|>", "<|im_end|>")])
    tok.save(str(path))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "pad_token": "<|im_end|>",
        "chat_template": SMOLLM2_TEMPLATE}))
    return out

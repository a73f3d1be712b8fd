"""Everything decided before a training run starts: the flags checked, the model, mesh,
rules, optimizer and layout planned, the data loaded. Nothing here compiles."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import jax

from jdist import data
from jdist.config import TrainConfig
from jdist.data import mixture, packing, sft
from jdist.data.tokenizer import load_tokenizer
from jdist.errors import require
from jdist.models import ModelConfig
from jdist.runtime.distributed import is_main_process
from jdist.step.from_flags import plan_for
from jdist.step.state import Plan


@dataclasses.dataclass
class Setup:
    """What `prepare` decided: the run's flags, model, data, layout and learning-rate schedule."""

    config: TrainConfig
    model: ModelConfig
    corpus: data.Corpus
    plan: Plan
    schedule: object
    rows: sft.SftData | None = None  # --data-format sft (then `corpus` holds their tokens)
    mix: mixture.Mixture | None = None  # --data A:W,B:W (then `corpus` describes it)

    def batch(self, step: int, stream: int = data.TRAIN_STREAM) -> dict:
        """The global batch of `step` (training or validation stream), laid out for the mesh."""
        flags = self.config.data
        if self.rows is not None:
            rows = self.rows.train if stream == data.TRAIN_STREAM else self.rows.val
            return sft.sft_batch(rows, flags.seed, step, flags.batch_size,
                                 self.plan.batch_sharding, stream)
        if self.mix is not None:
            return self.mix.global_batch(flags.seed, step, flags.batch_size, flags.seq_len,
                                         self.plan.batch_sharding, stream)
        tokens = self.corpus.train if stream == data.TRAIN_STREAM else self.corpus.val
        return data.global_batch(tokens, flags.seed, step, flags.batch_size, flags.seq_len,
                                 self.plan.batch_sharding, stream)

    def fingerprint(self) -> str:
        """The data's fingerprint, which a resumed run compares."""
        return self.mix.fingerprint() if self.mix else data.fingerprint(self.corpus)

    def token_counts(self) -> tuple[int, int]:
        """Train and validation tokens."""
        return self.mix.counts() if self.mix else (len(self.corpus.train), len(self.corpus.val))


def with_model_tokenizer(config: TrainConfig) -> TrainConfig:
    """`--init-from HF_DIR` reads text with the model's own tokenizer (HF_DIR/tokenizer.json),
    recorded as the run's --tokenizer, so generation and export find it too; a --tokenizer
    given instead must have the same vocabulary."""
    hf, given = config.model.init_from, config.data.tokenizer
    if not hf or not (Path(hf) / "tokenizer.json").is_file():
        return config
    if not given:
        return dataclasses.replace(config, data=dataclasses.replace(config.data, tokenizer=hf))
    own, other = load_tokenizer(hf), load_tokenizer(given)
    require(own.vocab_size == other.vocab_size,
            f"--tokenizer {given} has {other.vocab_size} tokens but the model's own tokenizer "
            f"(--init-from {hf}) has {own.vocab_size}; drop --tokenizer to use the model's own")
    return config


def check_tensor_files(hf_dir: str) -> None:
    """Every safetensors file `--init-from` names is there and opens: a missing shard is
    found before the run directory is written, not when the weights are read."""
    from jdist.hf.load import Source

    source = Source(hf_dir)
    for name in {file: name for name, file in source.weight_map.items()}.values():
        source.tensor(name)  # opens its file (one tensor per file)


def check_run_dir(config: TrainConfig, model: ModelConfig) -> None:
    """Refuse a --run-dir holding another run's records (config.json, metrics.jsonl) and no
    checkpoint, which starting there would overwrite. The same computation may start over
    (say, after a crash before its first save): it recomputes the records it replaces. With
    a checkpoint, resuming decides (`jdist.train.resume.find`)."""
    from jdist import checkpoint as ckpt
    from jdist.config import result_flags

    run_dir = Path(config.checkpoint.run_dir)
    record = run_dir / "config.json"
    if not config.checkpoint.run_dir or not record.is_file() or \
            ckpt.step_dirs(ckpt.checkpoint_root(run_dir)):
        return
    fix = f"choose a new --run-dir, or delete {run_dir} to reuse its name"
    try:
        saved = json.loads(record.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        saved = None
    require(isinstance(saved, dict) and isinstance(saved.get("train"), dict)
            and isinstance(saved.get("model"), dict),
            f"--run-dir {run_dir} holds a config.json that is not a jdist run's, which this "
            f"run would overwrite; {fix}")
    plain = lambda x: json.loads(json.dumps(x))
    for key, value in plain(dataclasses.asdict(model)).items():
        require(saved["model"].get(key) == value,
                f"--run-dir {run_dir} holds the records of another run (a model with "
                f"{key}={saved['model'].get(key)}, this run's has {key}={value}) and no "
                f"checkpoint; starting here would overwrite them; {fix}")
    defaults, current = plain(TrainConfig().flat()), plain(config.flat())
    for key in result_flags():
        was, flag = saved["train"].get(key, defaults[key]), "--" + key.replace("_", "-")
        require(was == current[key],
                f"--run-dir {run_dir} holds the records of another run ({flag} {was}, this "
                f"run has {flag} {current[key]}) and no checkpoint; starting here would "
                f"overwrite them; {fix}")


def prepare(config: TrainConfig) -> Setup:
    """Every check a user's input can fail happens here (`plan_for` validates the flags
    first), before anything is compiled."""
    config = with_model_tokenizer(config)
    model, plan, schedule = plan_for(config)
    check_run_dir(config, model)
    if config.model.init_from:
        check_tensor_files(config.model.init_from)
        if not config.data.tokenizer and is_main_process():
            print(f"note: --init-from {config.model.init_from} has no tokenizer.json: text is "
                  "read as bytes; pass --tokenizer with the model's own", file=sys.stderr,
                  flush=True)
    require(not (model.shape_only and jax.default_backend() == "cpu"),
            f"model preset {config.model.preset!r} is shape-only on CPU (too large to "
            "allocate); "
            "train 'tiny' or 'small' here, or plan it with --dry-run")
    tokenizer = load_tokenizer(config.data.tokenizer)
    require(not config.data.tokenizer or tokenizer.vocab_size <= model.vocab_size,
            f"--tokenizer {config.data.tokenizer} has {tokenizer.vocab_size} tokens but the "
            "model "
            f"vocabulary is {model.vocab_size}; " + (
                "use the tokenizer of that checkpoint" if config.model.init_from else
                f"pass --vocab-size {tokenizer.vocab_size} or larger"))
    # --data-dtype's default defers to a .bin's sidecar; only another value counts as given.
    dtype = None if config.data.data_dtype == "uint16" else config.data.data_dtype
    rows = sft.for_training(config, tokenizer) if config.data.data_format == sft.SFT else None
    parts = mixture.parse(config.data.path) if rows is None else None
    mix = mixture.load(parts, config.data.seq_len, dtype, tokenizer,
                       config.data.text_column) if parts else None
    corpus = rows.corpus() if rows is not None else mix.corpus() if mix else \
        data.load_corpus(config.data.path or None, config.data.seq_len, dtype,
                         tokenizer=tokenizer, text_column=config.data.text_column)
    data.check_vocab(corpus, model.vocab_size)
    # sft records are packed documents
    if config.data.packing == packing.DOCUMENTS or rows is not None:
        require(corpus.eod_id is not None,
                "--packing documents needs an end-of-document id, which byte-level data has "
                "not; pass --tokenizer (one with an eos token) or a .bin written by "
                "python -m jdist.data tokenize")
        plan = plan.computing(eod_id=corpus.eod_id)
    return Setup(config, model, corpus, plan, schedule, rows, mix)

"""`python -m jdist.generate`: complete prompts with a trained model, streaming the text of a
single prompt as it is produced. Generated text goes to stdout, everything else to stderr;
user mistakes are one line on stderr and exit status 2."""

from __future__ import annotations

import argparse
import itertools
import sys
import time

from jdist.errors import ArgumentParser, first_paragraph, require, run_cli

# Generation runs on the data, fsdp, tensor and expert axes (a mixture's experts split over
# devices, GSPMD moving the tokens): the others shard what decoding lacks (pipeline stages,
# the sequence of a one-token step).
SUPPORTED_AXES = ("data", "fsdp", "tensor", "expert")


def make_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="python -m jdist.generate", description=first_paragraph(__doc__))
    source = p.add_argument_group("model", "what to load (exactly one of the first two)")
    source.add_argument("--checkpoint", default="",
                        help="a jdist run directory (its newest checkpoint) or a step directory")
    source.add_argument("--init-from", default="", help="a Hugging Face checkpoint directory")
    source.add_argument("--tokenizer", default=None,
                        help="bytes, a Hugging Face tokenizer directory or tokenizer.json "
                             "(default: the checkpoint's or the --init-from directory's)")
    prompts = p.add_argument_group("prompts", "what to complete (one or both)")
    prompts.add_argument("--prompt", action="append", default=[],
                         help="prompt text (repeatable)")
    prompts.add_argument("--prompts-file", default="", help="a file of prompts, one per line")
    prompts.add_argument("--chat", action="store_true",
                         help="each prompt is a user's message, rendered with the tokenizer's "
                              "chat template; stdout gets the answers only; with no --prompt "
                              "or --prompts-file, the message is read from stdin")
    decoding = p.add_argument_group("decoding")
    decoding.add_argument("--max-new-tokens", type=int, default=64,
                          help="tokens generated per prompt")
    decoding.add_argument("--temperature", type=float, default=0.0,
                          help="sampling temperature; 0 decodes greedily")
    decoding.add_argument("--top-p", type=float, default=1.0,
                          help="nucleus sampling mass, in (0, 1]")
    decoding.add_argument("--seed", type=int, default=0, help="the sampling key's seed")
    decoding.add_argument("--max-context", type=int, default=0,
                          help="longest prompt plus --max-new-tokens, in tokens (default: an "
                               "HF model's max_position_embeddings, else 2048)")
    devices = p.add_argument_group("devices")
    devices.add_argument("--mesh", default="",
                         help="data, fsdp and tensor axes, e.g. tp=2 (default: one device)")
    devices.add_argument("--compute-dtype", choices=["float32", "bfloat16"], default="float32",
                         help="the dtype of the matmuls (weights stay as loaded)")
    return p


def check_args(args) -> None:
    from jdist.generate.sample import Sampling

    require(bool(args.checkpoint) != bool(args.init_from),
            "give exactly one of --checkpoint CKPT and --init-from HF_DIR")
    require(bool(args.prompt) or bool(args.prompts_file) or args.chat,
            "give a prompt: --prompt TEXT or --prompts-file FILE")
    require(args.max_new_tokens >= 1, f"--max-new-tokens {args.max_new_tokens} must be >= 1")
    require(args.max_context >= 0,
            f"--max-context {args.max_context} must be positive (or 0: the model's own)")
    Sampling(args.temperature, args.top_p).check()


def mesh_for(text: str):
    """The mesh over the first devices it needs (one by default; a -1 axis takes all)."""
    import jax

    from jdist.spmd.mesh import build_mesh, parse_mesh

    spec, devices = parse_mesh(text), jax.devices()
    n = spec.n_devices(default_fill=len(devices))
    require(n <= len(devices), f"--mesh {text} needs {n} devices but {len(devices)} are "
                               "available; use smaller axes")
    return build_mesh(spec, devices[:n])


def model_and_params(args):
    """(ModelConfig, restore(plan) -> parameters, the tokenizer to use)."""
    from jdist.generate import weights

    if args.checkpoint:
        found = weights.find_checkpoint(args.checkpoint)
        saved = found.meta.get("config", {}).get("tokenizer", "")
        return (weights.checkpoint_model(found),
                lambda plan: weights.restore_params(found, plan), args.tokenizer or saved)
    from jdist.hf.config import model_config
    from jdist.hf.load import load_params

    return (model_config(args.init_from), lambda plan: load_params(args.init_from, plan),
            args.tokenizer or args.init_from)


def valid_ids(cfg, tok) -> int:
    """How many of the model's ids may be generated: those the tokenizer can decode (a
    vocabulary padded to a multiple of 64 or 128 has rows no text maps to), said once."""
    if tok.vocab_size >= cfg.vocab_size:
        return 0
    print(f"note: the model's vocabulary ({cfg.vocab_size}) is padded past tokenizer "
          f"{tok.name}'s ({tok.vocab_size}); ids {tok.vocab_size}-{cfg.vocab_size - 1} are never "
          "generated", file=sys.stderr)
    return tok.vocab_size


def run(args) -> None:
    import jax.numpy as jnp

    from jdist.data.tokenizer import load_tokenizer
    from jdist.generate import cache_bytes, left_pad, stream
    from jdist.generate.placement import generation_rules
    from jdist.generate.sample import Sampling
    from jdist.generate.text import (
        TextStream,
        chat_prompts,
        complete,
        decode,
        encode_prompts,
        read_prompts,
    )
    from jdist.generate.weights import DEFAULT_CONTEXT, hf_context, inference_plan
    from jdist.spmd.mesh import describe

    check_args(args)
    texts = read_prompts(args)
    require(bool(texts), f"--prompts-file {args.prompts_file} holds no prompts; add some lines")
    dtype = jnp.dtype(args.compute_dtype)
    cfg, restore, tokenizer_spec = model_and_params(args)
    tok = load_tokenizer(tokenizer_spec)
    context = args.max_context or (hf_context(args.init_from) if args.init_from
                                   else DEFAULT_CONTEXT)
    inputs, stops = chat_prompts(tok, texts) if args.chat else (texts, {tok.eod_id})
    prompts = encode_prompts(tok, inputs, cfg.vocab_size, context, args.max_new_tokens,
                             rendered=args.chat)
    echo = [""] * len(texts) if args.chat else texts  # a chat's stdout is the answers
    mesh = mesh_for(args.mesh)
    rules, placed = generation_rules(cfg, mesh, dtype)
    params = restore(inference_plan(cfg, mesh, rules, dtype))
    max_len = left_pad(prompts)[0].shape[1] + args.max_new_tokens
    print(f"model: {cfg.n_params() / 1e6:.2f}M parameters; mesh: {describe(mesh)}; KV cache "
          f"{cache_bytes(cfg, len(prompts), max_len, dtype) / 2**20:.2f} MiB"
          + (f"; {placed}" if placed else ""), file=sys.stderr)
    shown = TextStream(tok) if len(prompts) == 1 else None
    if shown:
        print(echo[0], end="", flush=True)
    start = time.perf_counter()
    steps = stream(params, cfg, prompts, args.max_new_tokens, seed=args.seed, dtype=dtype,
                   rules=rules,
                   sampling=Sampling(args.temperature, args.top_p, valid_ids(cfg, tok)))
    first = next(steps)  # compiles the prefill and the decode step
    first_s = time.perf_counter() - start
    out = complete(itertools.chain([first], steps), len(prompts), stops,
                   shown.add if shown else None)
    elapsed = time.perf_counter() - start
    if shown:
        shown.close()
    for i, (text, ids) in enumerate(zip(echo, out) if not shown else ()):
        print(f"=== prompt {i} ===\n{text}{decode(tok, ids)}", flush=True)
    n = max(len(ids) for ids in out)
    rate = (n - 1) * len(prompts) / max(elapsed - first_s, 1e-9)
    print(f"generated {n} tokens x {len(prompts)} prompts in {elapsed:.2f}s (first token, "
          f"compiling included, {first_s:.2f}s; then {rate:,.1f} tokens/s)", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    def body() -> None:
        args = make_parser().parse_args(argv)
        from jdist.runtime.distributed import configure_devices
        from jdist.spmd.mesh import parse_mesh

        spec = parse_mesh(args.mesh)
        extra = [a for a, s in spec.sizes.items() if a not in SUPPORTED_AXES and s != 1]
        require(not extra, f"--mesh {args.mesh}: generation shards over "
                f"{', '.join(SUPPORTED_AXES)} only, not {', '.join(extra)}; e.g. --mesh tp=2")
        configure_devices(spec.n_devices(default_fill=8))
        run(args)
    return run_cli(body)


if __name__ == "__main__":
    sys.exit(main())

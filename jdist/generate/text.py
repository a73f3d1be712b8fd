"""Text in and out of generation: prompts read and encoded (checked against the model's
vocabulary and context), and completions streamed to stdout as their tokens arrive."""

from __future__ import annotations

import sys
from collections.abc import Collection
from pathlib import Path

import numpy as np

from jdist.errors import ConfigError, require


def read_prompts(args) -> list[str]:
    """The --prompt texts, then the non-blank lines of --prompts-file; with --chat and
    neither, one message read from stdin."""
    prompts = list(args.prompt)
    if args.chat and not prompts and not args.prompts_file:
        if sys.stdin.isatty():
            print("type the message, then Ctrl-D:", file=sys.stderr, flush=True)
        message = sys.stdin.read().strip()
        require(bool(message), "--chat read no message from stdin; pipe one in or pass "
                "--prompt TEXT")
        return [message]
    if args.prompts_file:
        try:
            lines = Path(args.prompts_file).read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"--prompts-file {args.prompts_file}: cannot read it ({e}); "
                              "pass a UTF-8 text file with one prompt per line") from None
        prompts += [line for line in lines if line.strip()]
    return prompts


def chat_prompts(tok, messages: list[str]) -> tuple[list[str], set[int]]:
    """`--chat`: each message as a user's turn rendered by the tokenizer's chat template,
    ready for the assistant's answer (transformers' `apply_chat_template(...,
    add_generation_prompt=True)`); and the ids that end an answer: the eos and the token
    that closes the template's turns."""
    from jdist.data.chat import chat_template, render, turn_end

    template = chat_template(tok)
    require(template is not None, f"--chat needs a chat template, which tokenizer {tok.name} "
            "has not (chat_template in tokenizer_config.json); pass --tokenizer with one, or "
            "drop --chat")
    texts = [render(template, tok, [{"role": "user", "content": m}], True, "--chat")
             for m in messages]
    return texts, {tok.eod_id, turn_end(template, tok)} - {None}


def encode_prompts(tok, texts: list[str], vocab_size: int, context: int,
                   new_tokens: int, rendered: bool = False) -> list[np.ndarray]:
    """Token ids of each prompt, encoded as `transformers` encodes a prompt (the special
    tokens the tokenizer's post-processor adds, `Tokenizer.encode_prompt`; none to a chat
    template's `rendered` text, which writes its own), checked against the model's
    vocabulary and against a `context` that must also hold `new_tokens`."""
    encode = tok.encode if rendered else tok.encode_prompt
    prompts = [encode(t).astype(np.int32) for t in texts]
    for i, ids in enumerate(prompts):
        require(len(ids) > 0, f"prompt {i} is empty; give some text to continue")
        require(len(ids) + new_tokens <= context,
                f"prompt {i} has {len(ids)} tokens, which with --max-new-tokens {new_tokens} "
                f"exceeds the model's context of {context} tokens; shorten it, lower "
                "--max-new-tokens or raise --max-context")
        require(int(ids.max()) < vocab_size, f"prompt {i} has token id {int(ids.max())}, "
                f"outside the model's vocabulary of {vocab_size}; pass the model's --tokenizer")
    return prompts


def decode(tok, ids) -> str:
    """The text of generated `ids`; an id outside the tokenizer (a model whose vocabulary is
    larger than the tokenizer it is run with) is a one-line error, not a traceback."""
    bad = next((i for i in ids if not 0 <= int(i) < tok.vocab_size), None)
    require(bad is None, f"the model generated token id {bad}, which tokenizer {tok.name} "
            f"cannot decode (its ids are 0-{tok.vocab_size - 1}); pass the tokenizer the model "
            "was trained with (--tokenizer)")
    return tok.decode(ids)


class TextStream:
    """Prints a completion as it grows: only the text added since the last print, holding
    back a trailing incomplete character (a multi-byte character split across tokens)."""

    def __init__(self, tok):
        self.tok, self.ids, self.shown = tok, [], ""

    def add(self, token: int) -> None:
        self.ids.append(token)
        text = decode(self.tok, self.ids).rstrip("\ufffd")
        if text.startswith(self.shown) and len(text) > len(self.shown):
            print(text[len(self.shown):], end="", flush=True)
            self.shown = text

    def close(self) -> None:
        print(decode(self.tok, self.ids)[len(self.shown):], flush=True)


def complete(steps, n_prompts: int, stops: Collection[int], on_token=None) -> list[list[int]]:
    """Collect each prompt's tokens from `steps` (jdist.generate.stream) until every prompt
    has ended with one of `stops` or the steps run out; `on_token(token)` sees prompt 0's."""
    out: list[list[int]] = [[] for _ in range(n_prompts)]
    for tokens in steps:
        for row, token in enumerate(tokens.tolist()):
            if out[row] and out[row][-1] in stops:
                continue
            out[row].append(token)
            if row == 0 and on_token is not None and token not in stops:
                on_token(token)
        if all(ids[-1] in stops for ids in out):
            break
    return [[t for t in ids if t not in stops] for ids in out]

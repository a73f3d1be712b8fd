"""Chat templates of Hugging Face tokenizers, rendered the way transformers renders them
(a sandboxed jinja2 environment with `trim_blocks` and `lstrip_blocks`, transformers'
`tojson` and `raise_exception`), for supervised fine-tuning data (`jdist.data.sft`)."""

from __future__ import annotations

import functools
import json
from pathlib import Path

from jdist.data.tokenizer import BYTES, Tokenizer
from jdist.errors import ConfigError


def chat_template(tokenizer: Tokenizer):
    """The tokenizer's chat template (`chat_template` of tokenizer_config.json, or a
    chat_template.jinja beside it) compiled as transformers compiles it, or None."""
    from jinja2 import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    if tokenizer.spec == BYTES:
        return None
    spec = Path(tokenizer.spec)
    folder = spec if spec.is_dir() else spec.parent
    config = folder / "tokenizer_config.json"
    source = json.loads(config.read_text(encoding="utf-8")).get("chat_template") \
        if config.is_file() else None
    if isinstance(source, list):  # several named templates: the default one
        source = next((t.get("template") for t in source if t.get("name") == "default"), None)
    if source is None and (folder / "chat_template.jinja").is_file():
        source = (folder / "chat_template.jinja").read_text(encoding="utf-8")
    if not source:
        return None
    # No strftime_now: a template then falls back to its fixed date, and the data stays a
    # pure function of the file (a resumed run must see the same tokens).
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    try:
        return env.from_string(source)
    except TemplateError as e:
        raise ConfigError(f"the chat template of tokenizer {tokenizer.name!r} does not parse "
                          f"({_first_line(e)}); fix it in {config}") from None


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # transformers' tojson: plain json.dumps (jinja2's own escapes HTML characters)
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _raise(message: str):
    from jinja2 import TemplateError

    raise TemplateError(message)


def _first_line(e: Exception) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def render(template, tokenizer: Tokenizer, messages: list, add_generation_prompt: bool,
           where: str = "") -> str:
    from jinja2 import TemplateError

    special = {f"{k}_token": "" if i is None else tokenizer.decode([i])
               for k, i in (("bos", tokenizer.bos_id), ("eos", tokenizer.eod_id))}
    try:
        return template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                               **special)
    except TemplateError as e:
        raise ConfigError(f"{where}: the chat template fails on this record ({_first_line(e)});"
                          " fix the record") from None


PROBE = "PROBE-ANSWER"  # an answer whose text the template cannot mistake for a marker


@functools.lru_cache(maxsize=8)
def turn_end(template, tokenizer: Tokenizer) -> int | None:
    """The special token that closes an assistant's turn in `template` (Llama 3's
    <|eot_id|>, ChatML's <|im_end|>, which SmolLM2 also names its eos): the first token
    after an answer's text, if special; None if the template closes turns with plain text
    or fails on a plain user/assistant exchange."""
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": PROBE}]
    try:
        text = render(template, tokenizer, messages, False)
    except ConfigError:
        return None
    after = tokenizer.encode(text.partition(PROBE)[2])
    return int(after[0]) if len(after) and tokenizer.is_special(int(after[0])) else None

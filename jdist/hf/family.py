"""The checks every Hugging Face family's config reader starts with (`jdist.hf.deepseek`,
`gemma`, `gpt_oss`): the architecture is the one its model_type names, and the weights
are not quantized."""

from __future__ import annotations

from jdist.errors import require


def require_architecture(c: dict, where: str, model_type: str, architecture: str,
                         note: str = "") -> None:
    require(c.get("architectures", [architecture]) == [architecture],
            f"{where}: architectures {c.get('architectures')} with model_type {model_type!r}; "
            f"only {architecture}{note} is supported")


def refuse_quantized(c: dict, where: str, published: str) -> None:
    """`published`: what the family's published checkpoints quantize, for the message."""
    require("quantization_config" not in c, f"{where}: the weights are quantized "
            f"({c.get('quantization_config', {}).get('quant_method', '?')}: {published}); "
            "dequantize them to bfloat16 first")

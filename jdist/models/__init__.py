"""Flax NNX model definitions. They name tensor dimensions with logical axes only."""

from jdist.models.config import PRESETS, ModelConfig, get_preset
from jdist.models.llama import Llama

__all__ = ["PRESETS", "Llama", "ModelConfig", "get_preset"]

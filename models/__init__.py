"""Flax NNX model definitions. They name tensor dimensions with logical axes only."""

from models.config import PRESETS, ModelConfig, get_preset
from models.llama import Llama

__all__ = ["PRESETS", "Llama", "ModelConfig", "get_preset"]

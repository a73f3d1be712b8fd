"""Hugging Face checkpoints in and out: `config.json` <-> `ModelConfig` (`config`), the
tensor names and layouts (`layout`), sharded loading (`load`) and export (`export`)."""

from jdist.hf.config import hf_config, model_config
from jdist.hf.load import Source, load_params

__all__ = ["Source", "hf_config", "load_params", "model_config"]

"""Hugging Face checkpoints in and out: `config.py` (config.json <-> ModelConfig, which the
flags need before any weight is read), `layout.py` (tensor names and layouts), `load.py`
(weights into a plan's layout), `export.py`, `peft.py`. Nothing is imported here, so reading
a config never loads the step."""

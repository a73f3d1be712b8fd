"""What every Hugging Face family's tests do alike: load a fixture directory into a
one-device plan, compare its logits with transformers' saved ones, and write it back."""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
from flax import nnx
from safetensors.numpy import load_file

from jdist.config import TrainConfig
from jdist.hf.config import model_config
from jdist.hf.export import write_hf
from jdist.hf.load import load_params
from jdist.step.from_flags import plan_for


def hf_tensors(hf_dir: Path) -> dict:
    out = {}
    for f in sorted(hf_dir.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def loaded(hf_dir: Path, mesh: str = "dp=1", **flags):
    _, plan, _ = plan_for(TrainConfig.of(init_from=str(hf_dir), mesh=mesh, batch_size=16,
                                         **flags))
    return plan, load_params(hf_dir, plan)


def at(tree, path):
    for k in path:
        tree = tree[k]
    return tree


def logits_error(plan, params, reference) -> float:
    """Relative L2 distance of the model's logits on `reference["input_ids"]` from
    `reference["logits"]` (float32, matmuls at highest precision)."""
    with jax.default_matmul_precision("highest"):
        model = nnx.merge(plan.graphdef, jax.tree.map(np.asarray, params))
        logits = np.asarray(model(reference["input_ids"]))
    expected = reference["logits"]
    return float(np.linalg.norm(logits - expected) / np.linalg.norm(expected))


def assert_round_trip_is_bitwise(hf_dir: Path, out: Path, plan, params) -> None:
    """`params` written to `out` as HF files hold `hf_dir`'s tensors byte for byte, and
    its config.json reads back as the plan's model."""
    host = jax.tree.map(np.asarray, params)
    write_hf(out, plan.model, lambda path: at(host, path), max_shard_bytes=100_000)
    original, exported = hf_tensors(hf_dir), hf_tensors(out)
    assert sorted(original) == sorted(exported)
    for name, value in original.items():
        assert exported[name].dtype == value.dtype and exported[name].tobytes() == value.tobytes()
    assert model_config(out) == plan.model

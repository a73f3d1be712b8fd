"""One process of the two-process sharded-loading test (tests/test_hf.py): join the group,
load the Hugging Face fixture onto fsdp=8 over both processes, and print (JSON) the bytes
this process read and the logits error against transformers' reference."""

import json
import sys

import jax
import numpy as np

jax.config.update("jax_num_cpu_devices", 4)
jax.config.update("jax_default_matmul_precision", "highest")

from flax import nnx  # noqa: E402

from jdist.config import TrainConfig  # noqa: E402
from jdist.hf.load import Source, load_params  # noqa: E402
from jdist.runtime.distributed import initialize  # noqa: E402
from jdist.spmd.sharding import replicated  # noqa: E402
from jdist.step.from_flags import plan_for  # noqa: E402


def main(hf_dir: str, coordinator: str, process_id: int) -> None:
    initialize(coordinator, 2, process_id)
    _, plan, _ = plan_for(TrainConfig.of(init_from=hf_dir, mesh="fsdp=8"))
    source = Source(hf_dir)
    params = load_params(hf_dir, plan, source)
    ref = np.load(f"{hf_dir}/reference.npz")
    forward = jax.jit(lambda p: nnx.merge(plan.graphdef, p)(ref["input_ids"]),
                      out_shardings=replicated(plan.mesh))
    logits = np.asarray(forward(params))
    err = np.linalg.norm(logits - ref["logits"]) / np.linalg.norm(ref["logits"])
    print(json.dumps({"process": jax.process_index(), "bytes_read": source.bytes_read,
                      "total": source.total_bytes(), "logits_rel_err": float(err)}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))

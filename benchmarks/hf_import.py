"""Importing a Hugging Face checkpoint (`--init-from`, `jdist.hf.load`): wall time and peak
host memory of loading a random `llama3.2-1b`-shaped checkpoint (bf16 safetensors, as
published) onto 8 simulated CPU devices with fsdp=8, beside the naive way (read every file
whole, then place the arrays). Each variant runs in its own process, so its peak resident
memory (`ru_maxrss`) is its own.

    python benchmarks/hf_import.py [--json] [--model llama3.2-1b] [--dir /tmp/jdist-hf-1b]

The checkpoint is written once (about 2.5 GB for 1b) and reused. On CPU the "devices" are
host memory, so the float32 parameters themselves (4.9 GB at 1b) count in both peaks; what
differs is what the loader holds besides them.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import common
from common import Column, GiB

COLUMNS = (Column("variant", "8"), Column("seconds", "8.1f"),
           Column("read", "6.2f", "bytes_read", GiB),
           Column("params", "7.2f", "param_bytes_f32", GiB),
           Column("peak anon", "10.2f", "peak_anon_bytes", GiB),
           Column("anon - params", "14.2f",
                  lambda r: r["peak_anon_bytes"] - r["param_bytes_f32"], GiB),
           Column("peak file", "10.2f", "peak_file_bytes", GiB),
           Column("peak RSS", "9.2f", "peak_rss_bytes", GiB))


def write_checkpoint(model: str, out: Path) -> None:
    import numpy as np

    from jdist.hf.export import write_hf
    from jdist.models import get_preset
    from jdist.models.config import ModelConfig

    cfg = get_preset(model)
    cfg = ModelConfig(**{**cfg.__dict__, "shape_only": False})
    rng = np.random.default_rng(0)
    shapes = _shapes(cfg)
    write_hf(out, cfg, lambda path: (0.02 * rng.standard_normal(shapes[path], np.float32)),
             dtype="bfloat16")


def _shapes(cfg) -> dict:
    import jax
    from flax import nnx

    from jdist.step.state import build_model

    tree = nnx.to_pure_dict(nnx.state(nnx.eval_shape(lambda: build_model(cfg, 0))))
    return {tuple(k.key for k in p): x.shape for p, x in jax.tree_util.tree_leaves_with_path(tree)}


class PeakMemory:
    """Peak anonymous and file-backed resident memory, sampled from /proc/self/status
    (Linux) every 5 ms: a memory-mapped checkpoint's pages are file-backed, reclaimable
    page cache; the loader's own buffers are anonymous."""

    def __enter__(self):
        import threading

        self.peak = {"RssAnon": 0, "RssFile": 0}
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()
        return self

    def _sample(self):
        while not self.done.wait(0.005):
            for line in Path("/proc/self/status").read_text().splitlines():
                key, _, value = line.partition(":")
                if key in self.peak:
                    self.peak[key] = max(self.peak[key], int(value.split()[0]) * 1024)

    def __exit__(self, *exc):
        self.done.set()
        self.thread.join()


def load(variant: str, hf_dir: str) -> dict:
    """Runs in a fresh process: load `hf_dir` onto fsdp=8 one way; time and peak memory."""
    common.setup_devices(8, cpu_only=True)
    import jax

    from jdist.config import TrainConfig
    from jdist.step.from_flags import plan_for

    _, plan, _ = plan_for(TrainConfig.of(init_from=hf_dir, mesh="fsdp=8"))
    with PeakMemory() as memory:
        start = time.perf_counter()
        params, read = _load(variant, hf_dir, plan)
        jax.block_until_ready(params)
        seconds = time.perf_counter() - start
    n = sum(x.size for x in jax.tree.leaves(params))
    return {"variant": variant, "seconds": seconds, "bytes_read": read,
            "param_bytes_f32": 4 * n, "peak_anon_bytes": memory.peak["RssAnon"],
            "peak_file_bytes": memory.peak["RssFile"],
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def _load(variant: str, hf_dir: str, plan):
    import jax
    import numpy as np
    from safetensors.numpy import load_file

    from jdist.hf.layout import hf_name, tensors
    from jdist.hf.load import Source, load_params

    if variant == "jdist":
        source = Source(hf_dir)
        params = load_params(hf_dir, plan, source)
        read = source.bytes_read
    else:  # every file whole into host memory, converted, then placed
        files = {}
        for f in sorted(Path(hf_dir).glob("*.safetensors")):
            files.update(load_file(f))
        read = sum(t.nbytes for t in files.values())

        table = tensors(plan.model)  # a dense model: one HF tensor per layer

        def leaf(path, abstract, sharding):
            keys = tuple(k.key for k in path)
            kind = table[keys][1]
            if keys[0] == "blocks":
                layers = [files[hf_name(table, keys, i)] for i in range(abstract.shape[0])]
                value = np.stack([_whole(kind, x, abstract.shape[1:]) for x in layers])
            else:
                value = _whole(kind, files[hf_name(table, keys)], abstract.shape)
            return jax.device_put(value.astype(np.float32), sharding)
        params = jax.tree_util.tree_map_with_path(leaf, plan.abstract.params,
                                                  plan.shardings.params)
    return params, read


def _whole(kind, x, shape):
    """The whole HF tensor `x` in jdist's layout (`layout.read` of every index)."""
    from jdist.hf.layout import read

    return read(lambda slices: x[slices], kind, shape, tuple(slice(None) for _ in shape))


def main() -> None:
    parser = common.make_parser(__doc__)
    parser.add_argument("--model", default="llama3.2-1b")
    parser.add_argument("--dir", default="/tmp/jdist-hf-1b")
    parser.add_argument("--run", choices=["jdist", "naive"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.run:
        print(json.dumps(load(args.run, args.dir)))
        return
    if not (Path(args.dir) / "config.json").exists():
        start = time.perf_counter()
        write_checkpoint(args.model, Path(args.dir))
        print(f"wrote {args.dir} in {time.perf_counter() - start:.0f}s", file=sys.stderr)
    rows = []
    for variant in ("jdist", "naive"):
        out = subprocess.run([sys.executable, __file__, "--run", variant, "--dir", args.dir],
                             capture_output=True, text=True, check=True)
        rows.append({"model": args.model, **json.loads(out.stdout.strip().splitlines()[-1])})
    common.emit(rows, args.json, lambda: [
        "GiB; 'anon - params': what the loader holds besides the float32 parameters (which "
        "on CPU devices are host memory too); 'file': page cache of the mapped checkpoint",
        *common.table(rows, COLUMNS),
        f"time ratio naive/jdist: {rows[1]['seconds'] / rows[0]['seconds']:.2f}"], indent=2)


if __name__ == "__main__":
    main()

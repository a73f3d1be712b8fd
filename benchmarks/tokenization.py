"""Tokenization throughput (MB/s, tokens/s) of the builtin corpus text: the library's calls
(per document, `encode_batch`) and `python -m jdist.data tokenize`'s path end to end (a
.jsonl file to a .bin, worker start-up included) with 1 and 2 workers.

    python benchmarks/tokenization.py [--max-mb 8] [--vocab 8192] [--tokenizer DIR] [--json]

Without --tokenizer, a byte-level BPE of --vocab ids is trained on the same text first
(not timed). Documents are the text split at blank-line pairs, about 3 KB each.
"""

import json
import os
import tempfile
import time
from pathlib import Path

import common
import numpy as np
from common import Column

from jdist import data
from jdist.data.tokenize import tokenize
from jdist.data.tokenizer import id_dtype, load_tokenizer, train_bpe

COLUMNS = (Column("path", "32"), Column("seconds", "8.2f"), Column("MB/s", "7.2f", "mb_per_s"),
           Column("tokens/s", "11,.0f", "tokens_per_s"))


def timed(fn) -> tuple[float, object]:
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def main() -> None:
    parser = common.make_parser(__doc__)
    parser.add_argument("--max-mb", type=float, default=8.0)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--tokenizer", default="", help="tokenizer to time (default: train one)")
    args = parser.parse_args()
    text = data.builtin_text(int(args.max_mb * 1e6)).decode("utf-8", errors="replace")
    docs = [d for d in text.split("\n\n\n") if d]
    mb = sum(len(d.encode()) for d in docs) / 1e6
    with tempfile.TemporaryDirectory() as tmp:
        spec = args.tokenizer or str(train_bpe(docs, args.vocab, Path(tmp) / "tok").parent)
        tok = load_tokenizer(spec)
        corpus = Path(tmp) / "docs.jsonl"
        corpus.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))

        def cli(workers: int) -> np.ndarray:
            out = Path(tmp) / f"w{workers}.bin"
            tokenize([str(corpus)], spec, str(out), workers=workers, progress=False)
            return np.fromfile(out, dtype=id_dtype(tok.vocab_size))

        runs = {"encode per document": lambda: [tok.encode(d) for d in docs],
                "encode_batch (library threads)": lambda: tok.encode_batch(docs),
                "tokenize --workers 1": lambda: cli(1), "tokenize --workers 2": lambda: cli(2)}
        rows, outputs = [], []
        for name, fn in runs.items():
            seconds, ids = timed(fn)
            if isinstance(ids, list):  # the library's calls: add what the file has between
                ids = np.concatenate([p for i in ids for p in (i, tok.separator())])
            outputs.append(ids.astype(np.int64))
            rows.append({"path": name, "seconds": seconds, "mb_per_s": mb / seconds,
                         "tokens_per_s": len(ids) / seconds})
    identical = all(np.array_equal(outputs[0], o) for o in outputs[1:])
    result = {"tokenizer": tok.name if args.tokenizer else f"trained BPE, {tok.vocab_size} ids",
              "mb": mb, "documents": len(docs), "cpus": os.cpu_count(), "rows": rows,
              "identical_ids": identical}
    common.emit(result, args.json, lambda: [
        f"{mb:.1f} MB, {len(docs)} documents, {result['tokenizer']}, {os.cpu_count()} CPUs",
        *common.table(rows, COLUMNS), f"identical ids on every path: {identical}"])


if __name__ == "__main__":
    main()

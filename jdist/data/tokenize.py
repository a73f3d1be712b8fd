"""Pre-tokenize text into a `.bin` of token ids that training memory-maps (`--data FILE.bin`).

Every text file is one document; every record of a `.jsonl` file is one document (its
`field`), and so is every row of a `.parquet` or `.arrow` file (its column `field`;
`jdist.data.hf_files`: a directory holding such files is read as them alone). Each
document's ids are followed by the tokenizer's separator (its eod id; a newline for bytes),
in input order whatever the worker count. Empty documents are skipped. The ids go to a
temporary file beside the output, renamed into place only once everything succeeded, with a
sidecar `FILE.bin.json` telling training the dtype and eod id.
"""

from __future__ import annotations

import collections
import json
import multiprocessing
import os
import tempfile
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np

from jdist.data import hf_files, jsonl_records, sidecar_path
from jdist.data.text import read_text, text_files
from jdist.data.tokenizer import Tokenizer, id_dtype, load_tokenizer
from jdist.errors import require, require_writable_dir

CHUNK_BYTES = 1 << 20  # text per task: big enough to amortise IPC, small enough to stream
_worker: Tokenizer | None = None


def input_files(inputs: list[str]) -> list[Path]:
    """Files in input order: a directory contributes its text files, sorted, recursively."""
    require(bool(inputs), "no INPUT given; pass text files, directories or .jsonl files")
    files = []
    for name in inputs:
        p = Path(name)
        require(p.exists(), f"input {name!r} does not exist; pass text files, directories of "
                            "text files, or .jsonl files")
        found = (hf_files.table_files(p) or text_files(p)) if p.is_dir() else [p]
        require(bool(found), f"input directory {name!r} has no text files; add some or drop it")
        files += found
    return files


def _jsonl(path: Path, field: str) -> Iterator[tuple[str, int]]:
    for where, record, size in jsonl_records(path):
        require(isinstance(record, dict) and field in record,
                f"{where} has no field {field!r}; pass --field with the field that holds "
                "the text, or fix the line")
        text = record[field]
        require(isinstance(text, str), f"{where}: field {field!r} is a "
                f"{type(text).__name__}, not a string; pass --field with the text's field")
        yield text, size


def documents(files: list[Path], field: str) -> Iterator[tuple[str, int]]:
    """(text, input bytes) of every document, in order."""
    for path in files:
        if path.suffix == ".jsonl":
            yield from _jsonl(path, field)
        elif hf_files.is_table(path):
            yield from hf_files.documents(path, field)
        else:
            raw = read_text(path)
            yield raw.decode("utf-8"), len(raw)


def chunks(docs: Iterable[tuple[str, int]]) -> Iterator[tuple[list[str], int]]:
    """Non-empty documents grouped into tasks of about CHUNK_BYTES: (texts, input bytes)."""
    texts, size = [], 0
    for text, nbytes in docs:
        if text:
            texts.append(text)
        size += nbytes
        if size >= CHUNK_BYTES:
            yield texts, size
            texts, size = [], 0
    if texts or size:
        yield texts, size


def encode_chunk(tok: Tokenizer, texts: list[str]) -> np.ndarray:
    """Each document's ids followed by the separator, concatenated, in the `.bin` dtype."""
    sep = tok.separator()
    parts = [p for ids in tok.encode_batch(texts) for p in (ids, sep)]
    return np.concatenate(parts).astype(id_dtype(tok.vocab_size)) if parts else \
        np.zeros(0, id_dtype(tok.vocab_size))


def _init_worker(spec: str) -> None:
    # One thread per process: the processes are the parallelism (no oversubscription).
    os.environ["RAYON_NUM_THREADS"] = "1"
    global _worker
    _worker = load_tokenizer(spec)


def _encode_in_worker(texts: list[str]) -> np.ndarray:
    return encode_chunk(_worker, texts)


def encoded(tok: Tokenizer, tasks: Iterable[tuple[list[str], int]], workers: int) -> Iterator:
    """(ids, documents, input bytes) per task, in order. One worker encodes in this process
    (the Rust library threads a batch itself); more use a spawn pool with a bounded queue, so
    reading never runs far ahead of encoding."""
    if workers <= 1:
        for texts, size in tasks:
            yield encode_chunk(tok, texts), len(texts), size
        return
    ctx = multiprocessing.get_context("spawn")  # workers load the tokenizer themselves
    with ctx.Pool(workers, initializer=_init_worker, initargs=(tok.spec,)) as pool:
        pending: collections.deque = collections.deque()
        for texts, size in tasks:
            pending.append((pool.apply_async(_encode_in_worker, (texts,)), len(texts), size))
            if len(pending) >= 2 * workers:
                job, n, s = pending.popleft()
                yield job.get(), n, s
        while pending:
            job, n, s = pending.popleft()
            yield job.get(), n, s


def _temp(out: Path, suffix: str) -> Path:
    """A hidden file beside `out` (same filesystem, so the final rename is atomic)."""
    fd, name = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.", suffix=suffix)
    os.close(fd)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(name, 0o666 & ~umask)  # mkstemp makes 0600; the output is an ordinary file
    return Path(name)


def tokenize(inputs: list[str], tokenizer: str, out: str, field: str = "text",
             workers: int = 1, progress: bool = True) -> dict:
    """Write `out` and its sidecar; returns the sidecar's contents plus timing. Any error
    leaves nothing behind."""
    from tqdm import tqdm

    start = time.perf_counter()
    out_path = Path(out)
    require(out_path.suffix == ".bin", f"--out {out!r} must end in .bin (training reads .bin "
                                       "files as token ids)")
    require_writable_dir(out_path.parent, f"--out {out}")
    require(out_path.parent.resolve().is_dir(), f"--out directory {str(out_path.parent)!r} "
                                                "does not exist; create it first")
    require(not out_path.is_dir(), f"--out {out} is a directory; name a FILE.bin")
    require(workers >= 1, f"--workers {workers} must be at least 1")
    tok = load_tokenizer(tokenizer)
    files = input_files(inputs)
    dtype = id_dtype(tok.vocab_size)
    ids_tmp, meta_tmp = _temp(out_path, ".tmp"), _temp(out_path, ".json.tmp")
    n_docs = n_tokens = n_bytes = 0
    try:
        bar = tqdm(total=sum(f.stat().st_size for f in files), unit="B", unit_scale=True,
                   desc="tokenize", leave=False, disable=None if progress else True)
        with ids_tmp.open("wb") as f, bar:
            for ids, docs, size in encoded(tok, chunks(documents(files, field)), workers):
                ids.tofile(f)
                n_docs, n_tokens, n_bytes = n_docs + docs, n_tokens + len(ids), n_bytes + size
                bar.update(size)
        require(n_docs > 0, f"inputs {' '.join(inputs)} hold no documents (every file or "
                            "record is empty); pass some text")
        meta = {"tokenizer": tok.name, "dtype": dtype.name, "vocab_size": tok.vocab_size,
                "eod_id": tok.eod_id, "documents": n_docs, "tokens": n_tokens}
        meta_tmp.write_text(json.dumps(meta, indent=1) + "\n")
        os.replace(ids_tmp, out_path)
        os.replace(meta_tmp, sidecar_path(out_path))
    finally:
        ids_tmp.unlink(missing_ok=True)
        meta_tmp.unlink(missing_ok=True)
    return {**meta, "input_bytes": n_bytes, "seconds": time.perf_counter() - start,
            "out": str(out_path)}


def summary(result: dict) -> str:
    mb, s = result["input_bytes"] / 1e6, result["seconds"]
    eod = "newline-separated" if result["eod_id"] is None else f"eod id {result['eod_id']}"
    return (f"tokenized {result['documents']:,} documents into {result['tokens']:,} tokens: "
            f"{mb:.1f} MB in {s:.1f} s ({mb / max(s, 1e-9):.2f} MB/s) -> {result['out']} "
            f"({result['dtype']}, {eod})")

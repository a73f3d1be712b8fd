"""Hugging Face datasets' own files, read directly: Parquet (the Hub's format,
`data/train-00000-of-00004.parquet`) and Arrow (what the `datasets` library caches and
`save_to_disk` writes, `data-00000-of-00001.arrow`: Arrow IPC streams; IPC files, also called
Feather v2, are read too). Training text comes from one string column (`--text-column`,
default "text"), one document per row; sft records from the columns prompt/completion or
messages. A file is read one record batch at a time, so `python -m jdist.data tokenize`
streams files larger than memory into a `.bin`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

from jdist.errors import ConfigError, require

SUFFIXES = (".parquet", ".arrow")
SFT_COLUMNS = ("prompt", "completion", "messages")
_COLUMN_FLAGS = "train: --text-column; python -m jdist.data tokenize: --field"
_IPC_FILE_MAGIC = b"ARROW1"  # an IPC file starts with it; a stream does not


def is_table(path: str | Path) -> bool:
    return Path(path).suffix in SUFFIXES


def table_files(path: Path) -> list[Path]:
    """A table file itself, or a directory's table files (recursively, sorted, hidden ones
    skipped): a dataset directory is read as its tables only (its README.md is a card)."""
    if not path.is_dir():
        return [path] if is_table(path) else []
    return [p for p in sorted(path.rglob("*")) if p.is_file() and is_table(p)
            and not any(part.startswith(".") for part in p.relative_to(path).parts)]


@contextlib.contextmanager
def _readable(path: Path):
    """Arrow's errors about the file as one line naming it."""
    import pyarrow as pa

    try:
        yield
    except (pa.ArrowException, OSError) as e:
        kind = "Parquet" if path.suffix == ".parquet" else "Arrow IPC"
        raise ConfigError(f"{path} is not a readable {kind} file ({str(e).splitlines()[0]}); "
                          "re-download or re-write it") from None


def _batches(path: Path, columns) -> Iterator:
    """The file's record batches, holding only `columns(schema names)`."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    with _readable(path):
        if path.suffix == ".parquet":
            f = pq.ParquetFile(path)
            yield from f.iter_batches(columns=columns(f.schema_arrow.names))
            return
        with pa.memory_map(str(path)) as source:
            is_file = source.read(len(_IPC_FILE_MAGIC)) == _IPC_FILE_MAGIC
            source.seek(0)
            reader = (pa.ipc.open_file if is_file else pa.ipc.open_stream)(source)
            chosen = columns(reader.schema.names)
            batches = (reader.get_batch(i) for i in range(reader.num_record_batches)) \
                if is_file else reader
            for batch in batches:
                yield batch.select(chosen)


def _text_column(path: Path, column: str):
    def choose(names: list[str]) -> list[str]:
        require(column in names, f"{path} has no column {column!r} (its columns: "
                f"{', '.join(names)}); name the one that holds the text ({_COLUMN_FLAGS})")
        return [column]
    return choose


def _row_count(path: Path) -> int:
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        with _readable(path):
            return pq.ParquetFile(path).metadata.num_rows
    return sum(batch.num_rows for batch in _batches(path, lambda names: []))  # reads no column


def documents(path: Path, column: str) -> Iterator[tuple[str, int]]:
    """(text, bytes) of every non-null row of `column`, in order. The bytes are the rows'
    share of the file (tokenize's progress and rate count input bytes)."""
    import pyarrow as pa

    size, rows = path.stat().st_size, max(1, _row_count(path))
    for batch in _batches(path, _text_column(path, column)):
        values = batch.column(0)
        require(pa.types.is_string(values.type) or pa.types.is_large_string(values.type),
                f"column {column!r} of {path} holds {values.type}, not text; name the one "
                f"that holds the text ({_COLUMN_FLAGS})")
        share = size * batch.num_rows // rows
        texts = [t for t in values.to_pylist() if t is not None]
        yield from ((t, share if i == 0 else 0) for i, t in enumerate(texts))


def texts(path: Path, column: str) -> list[bytes]:
    """Every document of the tables at `path` (a file or a dataset directory), as UTF-8."""
    return [t.encode("utf-8") for f in table_files(path) for t, _ in documents(f, column)]


def records(path: Path) -> Iterator[tuple[str, object, int]]:
    """(`FILE row N`, record dict, 0) of every row of the sft columns, like
    `jdist.data.jsonl_records`: the caller checks each record's shape."""
    def choose(names: list[str]) -> list[str]:
        found = [c for c in SFT_COLUMNS if c in names]
        require(bool(found), f"{path} has neither \"prompt\" and \"completion\" nor "
                f"\"messages\" columns (its columns: {', '.join(names)}); sft reads those")
        return found

    for f in table_files(path):
        n = 0
        for batch in _batches(f, choose):
            for record in batch.to_pylist():
                yield f"{f} row {n}", {k: v for k, v in record.items() if v is not None}, 0
                n += 1

"""Files read as training text: UTF-8 text, or refused in one line naming the file and the
first offending byte. Decoding with replacement would train on U+FFFD where the user's
characters were, and a binary file would train on its bytes, both without a word."""

from __future__ import annotations

from pathlib import Path

from jdist.errors import ConfigError, require

SNIFF_BYTES = 4096  # a directory's files with a NUL this early are binaries, passed over


def text_files(root: Path) -> list[Path]:
    """A directory's files, sorted, recursively, without hidden ones and binaries (a NUL byte
    in their first SNIFF_BYTES)."""
    files = []
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        if any(part.startswith(".") for part in path.relative_to(root).parts):
            continue
        with path.open("rb") as f:
            if b"\0" not in f.read(SNIFF_BYTES):
                files.append(path)
    return files


def check_text(raw: bytes, path: Path | str) -> None:
    """ConfigError unless `raw` (the bytes of `path`) is UTF-8 text without NUL bytes."""
    nul = raw.find(b"\0")
    require(nul < 0, f"{path} is not text (a NUL byte at offset {nul}); pass text files, or "
            "token ids as a .bin (python -m jdist.data tokenize writes one)")
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"{path} is not UTF-8 text (byte 0x{raw[e.start]:02x} at offset {e.start}); "
            f"convert it first, e.g. iconv -f latin1 -t utf-8 {path} > {Path(path).stem}"
            ".utf8.txt") from None


def read_text(path: Path) -> bytes:
    """The bytes of a text file, checked (`check_text`)."""
    raw = path.read_bytes()
    check_text(raw, path)
    return raw

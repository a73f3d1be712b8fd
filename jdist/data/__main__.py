"""`python -m jdist.data tokenize INPUT... --tokenizer T --out FILE.bin`: pre-tokenize text
for training (`python -m jdist.train --data FILE.bin`). Mistakes end with one line on stderr,
exit status 2 and nothing written. `python -m jdist.data clear-cache`: delete the cached
tokens of the built-in corpus (`jdist.data.cache`)."""

from __future__ import annotations

import argparse
import sys

from jdist.errors import ArgumentParser, run_cli


def make_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="python -m jdist.data", description="Token data tools.")
    commands = parser.add_subparsers(dest="command", required=True)
    tok = commands.add_parser(
        "tokenize", help="text, .jsonl, .parquet and .arrow files and directories to a .bin "
                         "of token ids",
        description="Every text file is one document, every .jsonl record and every "
                    ".parquet/.arrow row is one; each is "
                    "followed by the tokenizer's end-of-document id. Writes FILE.bin and "
                    "FILE.bin.json (dtype, eod id) atomically.")
    tok.add_argument("inputs", nargs="+", metavar="INPUT",
                     help="text file, directory (its text files, recursively; a dataset "
                     "directory's .parquet/.arrow files), .jsonl, .parquet or .arrow file")
    tok.add_argument("--tokenizer", default="",
                     help="Hugging Face tokenizer directory or tokenizer.json (default: bytes)")
    tok.add_argument("--out", required=True, help="output FILE.bin")
    tok.add_argument("--field", default="text",
                     help="the text's field in .jsonl records, its column in .parquet/.arrow")
    tok.add_argument("--workers", type=int, default=1,
                     help="tokenizer processes (1: this process, the library threads batches)")
    commands.add_parser(
        "clear-cache", help="delete the built-in corpus's cached tokens",
        description="Runs with --tokenizer keep the built-in corpus's ids in "
                    "$JDIST_CACHE_DIR/tokens (default ~/.cache/jdist/tokens), one file per "
                    "tokenizer; this deletes them (the next run re-tokenizes).")
    return parser


def main(argv: list[str] | None = None) -> int:
    from jdist.data.tokenize import summary, tokenize

    def body() -> None:
        args = make_parser().parse_args(sys.argv[1:] if argv is None else argv)
        if args.command == "clear-cache":
            from jdist.data import cache

            files, size, where = cache.clear()
            print(f"deleted {files} cached token files ({size / 2**20:,.1f} MiB) from {where}",
                  flush=True)
            return
        result = tokenize(args.inputs, args.tokenizer, args.out, args.field, args.workers)
        print(summary(result), flush=True)
    return run_cli(body)


if __name__ == "__main__":
    sys.exit(main())

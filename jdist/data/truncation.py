"""How many supervised fine-tuning records `--seq-len` cuts, and when that stops a run.

A record longer than a row is cut to one row, and what is cut is its end: the answer, the
only part an sft record trains on. A run whose rows cut more than `ALLOWED` of its records
is refused (`--allow-truncation` runs it anyway, with a warning); fewer are a warning. Both
name the --seq-len that would fit `ALLOWED`'s complement of the records, and all of them.
"""

from __future__ import annotations

import math

import numpy as np

from jdist.errors import require

ALLOWED = 0.05  # of the records: the suggested --seq-len fits the other 95%
ROUND = 64      # suggested lengths are rounded up to a multiple of this


def seq_len_for(lengths: np.ndarray, share: float) -> int:
    """The shortest --seq-len (a multiple of ROUND) whose rows hold `share` of the records
    whole: a document of L tokens fits a row of seq_len >= L (its closing target included)."""
    need = int(np.sort(lengths)[max(math.ceil(share * len(lengths)) - 1, 0)])
    return -(-need // ROUND) * ROUND


def check(lengths: np.ndarray, seq_len: int, allow: bool) -> str:
    """'' if no record is cut; a warning naming the counts and the --seq-len that fits
    more; a ConfigError if more than ALLOWED are cut and `allow` is not set."""
    cut = int((lengths > seq_len).sum())
    if cut == 0:
        return ""
    share = cut / len(lengths)
    said = (f"{cut:,} of {len(lengths):,} sft records ({share:.1%}) are longer than --seq-len "
            f"{seq_len} and are cut, losing the ends of their answers; --seq-len "
            f"{seq_len_for(lengths, 1 - ALLOWED)} fits {1 - ALLOWED:.0%} of them, "
            f"{seq_len_for(lengths, 1.0)} all")
    require(share <= ALLOWED or allow,
            f"{said}; pass one of those, or --allow-truncation to train on the cut records")
    return said

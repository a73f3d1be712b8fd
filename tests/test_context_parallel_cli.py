"""`--cp-strategy` from the command line: threaded into the plan, and every user mistake of
context parallelism reported in one line with exit status 2 before anything compiles."""

import pytest
from test_cli import TINY

from jdist.config import parse_args
from jdist.train.loop import prepare

BAD = [
    (["--mesh", "sp=8", "--seq-len", "40"],
     "--seq-len 40 does not split into 2 x sequence=8 equal chunks"),
    (["--mesh", "sp=8", "--cp-strategy", "ulysses", "--n-heads", "4", "--n-kv-heads", "4"],
     "--cp-strategy ulysses splits each device's 4 attention heads over sequence=8"),
    (["--mesh", "sp=4,tp=2", "--cp-strategy", "ulysses", "--n-heads", "4", "--n-kv-heads", "2"],
     "change --n-heads to a multiple of 8 or use --cp-strategy ring"),
    (["--mesh", "sp=2", "--cp-strategy", "zigzag"],
     "unknown context-parallel strategy 'zigzag'; use --cp-strategy ring, all_gather, ulysses"),
]


@pytest.mark.parametrize("args, message", BAD, ids=[a[-1] for a, _ in BAD])
def test_bad_context_parallel_input_is_one_line_and_exit_2(tmp_path, train_refusal, args,
                                                           message):
    run_dir = tmp_path / "run"
    assert message in train_refusal([*TINY, *args, "--run-dir", run_dir])
    assert not run_dir.exists()


def test_flag_reaches_the_plan():
    config = parse_args(["--model", "tiny", "--mesh", "sp=8", "--seq-len", "32",
                         "--cp-strategy", "ulysses"])
    assert prepare(config).plan.compute.cp_strategy == "ulysses"
    assert parse_args([]).parallel.cp_strategy == "ring"

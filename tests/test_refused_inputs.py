"""Flags and data that trained anyway (issue 46, item 5) are refused in one line before
anything is written: a learning rate, warmup, weight decay or clipping norm that makes no
sense, pipeline and sequence-parallel flags without their mesh axis, a preset beside
--init-from, and training text that is not UTF-8 or is a binary file. Through the command
line's own parse and plan path in-process, and once as a real `python -m jdist.train`."""

import subprocess
import sys
from pathlib import Path

import pytest

from jdist.config import parse_args
from jdist.errors import ConfigError
from jdist.step.from_flags import plan_for
from jdist.train.setup import prepare

HF = Path(__file__).parent / "fixtures" / "hf" / "llama-untied"
TINY = ["--model", "tiny", "--batch-size", "8", "--seq-len", "32", "--steps", "4"]
LATIN1 = "caf\xe9 au lait, s'il vous pla\xeet\n".encode("latin-1") * 40
NOT_UTF8 = "is not UTF-8 text (byte 0xe9 at offset 3); convert it first, e.g. iconv"

# (flags, what the one line says). LATIN1, BLOB, DOCS: files written by the test.
REFUSED = [
    (["--lr", "-1"], "--lr -1.0 must be 0 (no update) or positive"),
    (["--lr", "nan"], "--lr nan must be 0 (no update) or positive"),
    (["--weight-decay", "-0.1"], "--weight-decay -0.1 must be 0 (none) or positive"),
    (["--clip-norm", "0"], "--clip-norm 0.0 must be positive"),
    (["--warmup", "-2"], "--warmup -2 must be 0 (none) or positive"),
    (["--warmup", "4"], "--warmup 4 is not below --steps 4: no step would be left for the "
                        "decay; pass --warmup below 4 (0: none)"),
    (["--mesh", "dp=2", "--pp-schedule", "gpipe"],
     "--pp-schedule gpipe pipelines the model over stages, but --mesh dp=2 has no pp; add "
     "pp=P to --mesh or drop the flag"),
    (["--mesh", "fsdp=2", "--sequence-parallel"],
     "--sequence-parallel shards activations over the tensor axis between tensor-parallel "
     "regions, but --mesh fsdp=2 has no tp; add tp=T to --mesh or drop --sequence-parallel"),
    (["--init-from", str(HF)], f"--init-from takes the model from {HF}/config.json, not from "
                               "a preset; drop --model tiny"),
    (["--data", "LATIN1"], NOT_UTF8),
    (["--data", "DOCS"], NOT_UTF8),  # a directory: its text files are checked the same
    (["--data", "BLOB"], "is not text (a NUL byte at offset 1); pass text files, or token ids "
                         "as a .bin"),
]


def files(tmp_path: Path) -> dict[str, Path]:
    (tmp_path / "latin1.txt").write_bytes(LATIN1)
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.txt").write_text("plain text\n" * 100)
    (tmp_path / "docs" / "b.txt").write_bytes(LATIN1)
    (tmp_path / "blob.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}" * 500)
    return {"LATIN1": tmp_path / "latin1.txt", "DOCS": tmp_path / "docs",
            "BLOB": tmp_path / "blob.safetensors"}


@pytest.mark.parametrize("flags, message", REFUSED,
                         ids=["lr-1", "lr-nan", "wd", "clip", "warmup-neg",
                              "warmup-steps", "pp-schedule", "sequence-parallel",
                              "model-init-from", "latin1", "latin1-in-dir", "binary"])
def test_what_trained_anyway_is_refused_in_one_line(tmp_path, flags, message):
    given = files(tmp_path)
    argv = [*TINY, *(str(given.get(a, a)) for a in flags)]
    with pytest.raises(ConfigError) as refused:
        prepare(parse_args(argv))
    text = str(refused.value)
    assert message in text and "\n" not in text, text
    if "DOCS" in flags:
        assert str(given["DOCS"] / "b.txt") in text  # the file, not the directory
    elif any(f in flags for f in ("LATIN1", "BLOB")):
        assert text.startswith(str(given[flags[1]])), text


def test_short_runs_cut_the_default_warmup_and_text_that_is_utf8_trains(tmp_path):
    """What stays accepted: the default warmup (30) in a 4-step run is cut to 3, as --warmup's
    help says; --lr 0 is a run that updates nothing; UTF-8 text beyond ASCII reads as it
    is."""
    text = tmp_path / "utf8.txt"
    text.write_text("café — 東京 🚀\n" * 100, encoding="utf-8")
    setup = prepare(parse_args([*TINY, "--data", str(text)]))
    assert [float(setup.schedule(c)) / 3e-3 for c in range(3)] == \
        pytest.approx([1 / 3, 2 / 3, 1])
    # --lr 0 keeps the weights as they start (tests/test_hf.py checks an export that way).
    assert float(plan_for(parse_args([*TINY, "--lr", "0"]))[2](0)) == 0
    assert bytes(setup.corpus.train[:5]) == "café".encode()


def test_the_command_line_exits_2_with_one_line(tmp_path):
    run_dir = tmp_path / "run"
    result = subprocess.run([sys.executable, "-m", "jdist.train", *TINY, "--lr", "-1",
                             "--run-dir", str(run_dir)],
                            check=False, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.strip().splitlines() == [
        "jdist: error: --lr -1.0 must be 0 (no update) or positive (the peak learning "
        "rate, e.g. 3e-4)"]
    assert "Traceback" not in result.stdout and not run_dir.exists()

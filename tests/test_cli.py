"""`python -m jdist.train` end to end: a real run, and every user mistake the issue lists."""

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

TINY = ["--model", "tiny", "--steps", "4", "--batch-size", "8", "--seq-len", "32"]


def run_cli(*args: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "jdist.train", *args], check=False,
                          capture_output=True, text=True, timeout=300, cwd=cwd)


def test_run_writes_config_and_metrics(tmp_path):
    rules = tmp_path / "rules.toml"
    rules.write_text('[rules]\nembed = []\n')  # replicate the model dimension of parameters
    result = run_cli(*TINY, "--mesh", "dp=2,fsdp=2,tp=2", "--eval-every", "2",
                     "--rules", str(rules), "--run-dir", str(tmp_path / "run"),
                     "--attention", "flash")
    assert result.returncode == 0, result.stderr
    assert "mesh: data=2 fsdp=2 tensor=2 (8 devices, cpu)" in result.stdout
    assert "blocks.mlp.w_up" in result.stdout and "per-device bytes" in result.stdout
    assert "attention: flash (--attention flash); loss: chunked" in result.stdout
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert config["mesh"]["tensor"] == 2 and config["train"]["steps"] == 4
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2, 3, 4]
    for key in ("loss", "grad_norm", "lr", "tokens_per_sec", "step_time_s"):
        assert all(key in x for x in lines)
    assert all(x["attention"] == "flash" for x in lines)
    assert "val_loss" in lines[1] and "val_loss" in lines[3] and "val_loss" not in lines[0]
    assert "step 4/4" in result.stdout  # progress goes to stdout (tests/test_observe.py)


BAD = [
    (["--mesh", "dp2,tp=2"], "malformed mesh entry 'dp2'"),
    (["--mesh", "gpu=2"], "unknown mesh axis 'gpu'"),
    (["--mesh", "dp=8", "--cpu-devices", "4"], "needs 8 devices but 4 are available"),
    (["--mesh", "tp=4", "--n-heads", "6", "--n-kv-heads", "2", "--d-model", "48"],
     "heads dimension 6 is not divisible by tensor=4"),
    (["--mesh", "tp=4", "--n-heads", "8", "--n-kv-heads", "2"],
     "kv_heads dimension 2 is not divisible by tensor=4"),
    (["--mesh", "tp=4", "--d-ff", "130"], "change --d-ff to a multiple of 4"),
    (["--mesh", "tp=4", "--vocab-size", "258"], "change --vocab-size to a multiple of 4"),
    (["--mesh", "dp=4", "--batch-size", "6"], "change --batch-size to a multiple of 4"),
    (["--mesh", "sp=2", "--seq-len", "63"], "change --seq-len to a multiple of 2"),
    (["--model", "huge"], "unknown model preset 'huge'"),
    (["--model", "7b"], "shape-only on CPU"),
    (["--data", "/nonexistent/corpus.txt"], "does not exist"),
    (["--data", "EMPTY"], "too few for --seq-len"),
    (["--rules", "/nonexistent/rules.toml"], "rules file '/nonexistent/rules.toml' does not exist"),
    (["--bogus-flag"], "unrecognized arguments: --bogus-flag"),
    (["--attention", "cudnn"], "cuDNN attention needs an NVIDIA GPU"),
    (["--mesh", "sp=2", "--attention", "xla"], "cannot run on a sequence-sharded mesh"),
    (["--mesh", "dp=2", "--vocab-size", "128"], "pass --vocab-size 256 or larger"),
    (["--mesh", "tp=2", "--collective-matmul", "on"],
     "--collective-matmul on needs --sequence-parallel"),
]


# The whole process (its exit status, nothing else on stderr from startup) on the first and
# on --cpu-devices, which this process's 8 devices would not show; the rest in this process
# (conftest's train_refusal).
OWN_PROCESS = {BAD[0][1], "needs 8 devices but 4 are available"}


@pytest.mark.parametrize("args, message", BAD, ids=[m.split(" ")[0] + str(i)
                                                    for i, (_, m) in enumerate(BAD)])
def test_bad_input_is_one_line_and_exit_2(tmp_path, train_refusal, args, message):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    run_dir = tmp_path / "run"
    argv = [*TINY, *(str(empty) if a == "EMPTY" else a for a in args), "--run-dir", str(run_dir)]
    if message in OWN_PROCESS:
        result = run_cli(*argv)
        assert result.returncode == 2, result.stderr
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1, result.stderr
        assert "Traceback" not in result.stderr + result.stdout
        line = lines[0]
    else:
        line = train_refusal(argv)
    assert line.startswith("jdist: error: ") and message in line, line
    assert not run_dir.exists()  # nothing written for a run that never started


# Mistakes that trained anyway (exit 0). OTHER_RUN: a real run's records without its
# checkpoints (tests/fixtures/checkpoint_v1, a model with d_model=32).
ACCEPTED = [
    (["--rules", "TYPO_RULES"], "names unknown logical axis 'embd'; did you mean 'embed'?"),
    (["--profile-steps", "5-6"], "--profile-steps 5-6 goes past --steps 4"),
    (["--data", "RECORDS"], "which --data-format text would train on as raw JSON text; pass "
                            "--data-format sft"),
    (["--run-dir", "OTHER_RUN"], "holds the records of another run (a model with d_model=32, "
                                 "this run's has d_model=64) and no checkpoint"),
]


@pytest.mark.parametrize("args, message", ACCEPTED, ids=["rules", "profile", "jsonl", "run-dir"])
def test_mistakes_once_accepted_are_one_line_and_exit_2(tmp_path, train_refusal, args,
                                                          message):
    other = tmp_path / "other"
    shutil.copytree(Path(__file__).parent / "fixtures" / "checkpoint_v1", other,
                    ignore=shutil.ignore_patterns("checkpoints"))
    records = {p.name: p.read_bytes() for p in other.iterdir()}
    (tmp_path / "rules.toml").write_text('[rules]\nembd = ["tensor"]\n')
    (tmp_path / "records.jsonl").write_text('{"prompt": "1 + 1 = ", "completion": "2"}\n' * 99)
    given = {"TYPO_RULES": tmp_path / "rules.toml", "RECORDS": tmp_path / "records.jsonl",
             "OTHER_RUN": other}
    run_dir = tmp_path / "run"
    line = train_refusal([*TINY, "--run-dir", run_dir, *(given.get(a, a) for a in args)])
    assert message in line, line
    assert not run_dir.exists()
    assert {p.name: p.read_bytes() for p in other.iterdir()} == records  # nothing overwritten


FIXTURES = Path(__file__).parent / "fixtures"
# (command, arguments, what the one line must say, what it must not). RUN: a run directory
# with a checkpoint of a d_model=32 model; BROKEN: the same with an unfinished save; HF: a
# sharded Hugging Face model missing a shard; NEW: a run directory nothing may create.
MISLEADING = [
    ("jdist.train", [*TINY, "--run-dir", "RUN"],
     "is of a model with d_model=32 but this run's model has d_model=64", "different data"),
    ("jdist.train", [*TINY, "--init-from", "RUN", "--run-dir", "NEW"],
     "that is a jdist training run or checkpoint, not a Hugging Face model; continue training "
     "it with --resume", "vocab_size"),
    ("jdist.generate", ["--checkpoint", "BROKEN", "--prompt", "hi"],
     "checkpoint is not usable", "--resume"),
    ("jdist.export", ["NEW", "--hf", "NEW"], "jdist.export: error: checkpoint ",
     "jdist.export: error: jdist.export"),
    ("jdist.launch", ["--nproc", "2", "--model", "tiny"],
     "training flags go after --, e.g. python -m jdist.launch --nproc 2 -- --model tiny", None),
    ("jdist.train", [*TINY, "--lora-rank", "4", "--quantize-base", "nf4", "--run-dir", "NEW"],
     "not a whole number of NF4 blocks of 64 on any mesh; QLoRA needs a model whose head "
     "dimension", "no axis"),
    ("jdist.train", ["--init-from", "HF", "--steps", "1", "--seq-len", "32", "--run-dir", "NEW"],
     "model-00003-of-00006.safetensors (named in model.safetensors.index.json) is missing",
     None),
]


@pytest.mark.parametrize("command, args, says, never", MISLEADING,
                         ids=["resume-model", "init-from-run", "generate", "export", "launch",
                              "qlora", "hf-shard"])
def test_messages_name_the_real_problem(tmp_path, train_refusal, command, args, says,
                                        never):
    given = {"RUN": tmp_path / "run", "BROKEN": tmp_path / "broken", "HF": tmp_path / "hf",
             "NEW": tmp_path / "new"}
    shutil.copytree(FIXTURES / "checkpoint_v1", given["RUN"])
    shutil.copytree(FIXTURES / "checkpoint_v1", given["BROKEN"])
    (given["BROKEN"] / "checkpoints" / "2" / "jdist_manifest.json").unlink()
    shutil.copytree(FIXTURES / "hf" / "llama-untied", given["HF"])
    (given["HF"] / "model-00003-of-00006.safetensors").unlink()
    argv = [str(given.get(a, a)) for a in args]
    if command == "jdist.train":  # in this process (conftest's train_refusal)
        line = train_refusal(argv)
    else:
        result = subprocess.run([sys.executable, "-m", command, *argv],
                                check=False, capture_output=True, text=True, timeout=300)
        assert result.returncode == 2, result.stdout + result.stderr
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in result.stderr + result.stdout, \
            result.stderr
        line = lines[0]
    assert says in line and (never is None or never not in line), line
    assert not given["NEW"].exists()  # nothing written


UNWRITABLE = [  # (command, args, the flag and value named); FILE is a regular file
    ("jdist.train", [*TINY, "--run-dir", "FILE/x"], "--run-dir FILE/x"),
    ("jdist.train", [*TINY, "--run-dir", "/proc/x"], "--run-dir /proc/x"),
    ("jdist.export", ["RUN", "--hf", "FILE/x"], "--hf FILE/x"),
    ("jdist.export", ["RUN", "--peft", "/proc/x"], "--peft /proc/x"),
    ("jdist.data", ["tokenize", "TEXT", "--out", "FILE/x.bin"], "--out FILE/x.bin"),
    ("jdist.data", ["tokenize", "TEXT", "--out", "/proc/x.bin"], "--out /proc/x.bin"),
]


@pytest.mark.parametrize("command, args, names", UNWRITABLE,
                         ids=["train-file", "train-proc", "export-file", "export-proc",
                              "tokenize-file", "tokenize-proc"])
def test_unwritable_outputs_are_one_line_exit_2_before_any_work(tmp_path, command, args,
                                                                names):
    """Under a regular file or in /proc: one line naming the flag, exit 2, nothing written
    (checked before the run loads data, or the export reads the checkpoint)."""
    shutil.copytree(FIXTURES / "checkpoint_v1", tmp_path / "run")
    (tmp_path / "file").write_text("a file, not a directory\n")
    (tmp_path / "text.txt").write_text("some text\n")
    given = {"RUN": str(tmp_path / "run"), "TEXT": str(tmp_path / "text.txt")}
    here = lambda a: given.get(a, a.replace("FILE", str(tmp_path / "file")))
    files = lambda: sorted(p for p in tmp_path.rglob("*"))
    before = files()
    result = subprocess.run([sys.executable, "-m", command, *map(here, args)], check=False,
                            capture_output=True, text=True, timeout=300)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stdout + result.stderr
    assert here(names) + ": " in lines[0], lines[0]
    assert ("is a file, not a directory" if "FILE" in names else "cannot create") in lines[0]
    assert "data:" not in result.stdout and "restored" not in result.stderr  # no work done
    assert files() == before and not Path("/proc/x").exists()


def test_readme_lists_every_exit_status():
    from jdist import errors

    readme = (Path(__file__).parents[1] / "README.md").read_text()
    listed = {int(m) for m in re.findall(r"^\| (\d+) \|", readme, re.MULTILINE)}
    assert listed == {v for k, v in vars(errors).items() if k.startswith("EXIT_")}


def test_process_split_counts_accelerators_as_they_are(monkeypatch):
    """A -1 axis fills 8 simulated devices on CPU, but the devices there are elsewhere."""
    import jax

    from jdist.errors import ConfigError
    from jdist.runtime.distributed import check_process_split

    with pytest.raises(ConfigError, match="8 devices cannot be split evenly over 3 processes"):
        check_process_split(8, 3)  # CPU: `--mesh fsdp=-1` over 3 processes
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(jax, "device_count", lambda: 12)
    check_process_split(8, 3)  # 3 hosts of 4 GPUs
    monkeypatch.setattr(jax, "device_count", lambda: 10)
    with pytest.raises(ConfigError, match="10 devices cannot be split evenly over 3"):
        check_process_split(8, 3)


COMMANDS = {"train": "jdist.train.__main__", "generate": "jdist.generate.__main__",
            "launch": "jdist.launch", "plan": "jdist.plan.__main__",
            "memory": "jdist.memory.__main__", "export": "jdist.export",
            "data": "jdist.data.__main__"}


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_help_describes_every_flag_in_whole_sentences(command, capsys):
    """`--help` of every command: exit 0, a description that ends its sentence (a
    docstring's first line stopped mid-sentence: "streaming the text of a"), and help text
    for every flag."""
    import importlib

    main = importlib.import_module(COMMANDS[command]).main
    with pytest.raises(SystemExit) as stop:
        main(["--help"])
    assert stop.value.code == 0
    text = capsys.readouterr().out
    description = text.split("\n\n")[1]
    assert description.rstrip().endswith((".", ")")), description
    lines = text.splitlines()
    for i, line in enumerate(lines):  # help beside the flag, or on the next line, indented
        flag = re.match(r"  (?:-\w, )?(--[\w-]+)(?: \S+)?( {2,}\S.*)?$", line)
        if flag:
            beneath = i + 1 < len(lines) and re.match(r" {20,}\S", lines[i + 1])
            assert flag.group(2) or beneath, (command, flag.group(1))

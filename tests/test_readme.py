"""The README's commands and custom training loop work as written, the command lines in the
README and docs/ still parse, and their links lead somewhere."""

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
README = (ROOT / "README.md").read_text()
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

# Commands whose parser is built inside main() with no factory to call: parsing their lines
# would mean running the command. Their lines are collected but not parsed until the module
# has a `make_parser()`. For jdist.launch the training flags after `--` are parsed (the
# launcher hands them to jdist.train as they are); its own flags are not.
NOT_YET_PARSED: dict[str, str] = {}  # module -> why its command lines cannot be parsed yet
PARSED = {"jdist.train", "jdist.generate", "jdist.plan", "jdist.data", "jdist.launch",
          "jdist.export", "jdist.memory"}


def test_readme_starts_with_install_and_test_commands():
    first_block = re.search(r"```bash\n(.*?)```", README, re.DOTALL).group(1).strip().splitlines()
    assert first_block == ['pip install -e ".[dev]" && python -m jdist.train', "python -m pytest"]


def test_custom_loop_runs_as_written(tmp_path):
    code = README.split("## Python API", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    result = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True,
                            text=True,
                            timeout=300, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    losses = [float(x) for x in re.findall(r"loss (\d+\.\d+)", result.stdout)]
    assert len(losses) == 4 and losses[-1] < losses[0] - 1.0, result.stdout


def shell_lines(page: Path):
    """(line number, line) of every shell line in the page's code blocks, continuations
    joined. ```bash blocks give every line; other blocks (program output) only their
    `$ ` lines, which are commands too."""
    text = page.read_text()
    block = re.compile(r"^([ \t]*)```(\w*)\n(.*?)^[ \t]*```", re.MULTILINE | re.DOTALL)
    for m in block.finditer(text):
        indent, lang, body = m.groups()
        first = text.count("\n", 0, m.start(3)) + 1
        lines = [line.removeprefix(indent) for line in body.splitlines()]
        i = 0
        while i < len(lines):
            start, line = first + i, lines[i]
            while line.endswith("\\") and i + 1 < len(lines):
                i += 1
                line = line[:-1] + " " + lines[i].strip()
            i += 1
            line = line.strip()
            if line.startswith("$ "):
                yield start, line[2:]
            elif lang == "bash":
                yield start, line


def jdist_commands(line: str) -> list[list[str]]:
    """The `python -m jdist.X ...` commands on one shell line, as argv lists (from `jdist.X`
    on): split at `&&`, `||`, `;` and `|`, each cut at a redirection; comments dropped."""
    line = re.sub(r"\s\d+(?=[<>])", " ", line)  # `2>&1`: the descriptor goes with the redirection
    lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|<>")
    lexer.whitespace_split = True
    lexer.commenters = "#"
    commands, current = [], []
    for token in [*lexer, ";"]:
        if token in {"&&", "||", ";", "|", "&"}:
            commands.append(current)
            current = []
        else:
            current.append(token)
    found = []
    for argv in commands:
        argv = argv[:next((i for i, t in enumerate(argv) if set(t) <= set("<>&")), len(argv))]
        if len(argv) >= 3 and argv[0] in {"python", "python3"} and argv[1] == "-m" \
                and argv[2].startswith("jdist."):
            found.append(argv[2:])
    return found


def is_placeholder(line: str) -> bool:
    """`...` stands for flags left out, `[--flag value]` for optional ones: not a command as
    written."""
    return "..." in line or re.search(r"\[-", line) is not None


COMMANDS = [(f"{page.relative_to(ROOT)}:{number}", argv)
            for page in PAGES for number, line in shell_lines(page)
            if not is_placeholder(line) for argv in jdist_commands(line)]


def parse(module: str, argv: list[str]) -> None:
    """Parse `python -m MODULE ARGV` with the command's own parser, running nothing. Raises
    ConfigError (jdist's parsers) or SystemExit (plain argparse) on a bad command line."""
    if module == "jdist.train":
        from jdist.config import parse_args
        parse_args(argv)
    elif module == "jdist.generate":
        from jdist.generate.__main__ import make_parser
        make_parser().parse_args(argv)
    elif module == "jdist.plan":
        if argv[:1] == ["calibrate"]:  # a subcommand with its own parser (jdist.plan's main)
            from jdist.plan.calibrate import parse_args
            parse_args(argv[1:])
        else:
            from jdist.plan.__main__ import make_parser
            make_parser().parse_args(argv)
    elif module == "jdist.data":
        from jdist.data.__main__ import make_parser
        make_parser().parse_args(argv)
    elif module in ("jdist.export", "jdist.memory"):
        import importlib
        name = module + (".__main__" if module == "jdist.memory" else "")
        importlib.import_module(name).make_parser().parse_args(argv)
    elif module == "jdist.launch":  # its own flags, then the training flags after --
        from jdist.launch import make_parser
        ours = argv[:argv.index("--")] if "--" in argv else argv
        _, unknown = make_parser().parse_known_args(ours)
        assert not unknown, f"unknown launcher flags {unknown}"
        if "--" in argv:
            parse("jdist.train", argv[argv.index("--") + 1:])
    else:
        raise AssertionError(f"no parser for {module}")


def test_the_pages_show_commands_of_every_kind():
    """Guards the extraction: were it to find nothing, the test below would pass vacuously."""
    seen = {argv[0] for _, argv in COMMANDS}
    assert len(COMMANDS) >= 30, COMMANDS
    assert seen >= PARSED | set(NOT_YET_PARSED), seen


@pytest.mark.parametrize("where, argv", COMMANDS, ids=[w for w, _ in COMMANDS])
def test_command_line_parses(where, argv):
    from jdist.errors import ConfigError

    module, args = argv[0], argv[1:]
    line = f"{where}: python -m {shlex.join(argv)}"
    assert module in PARSED | set(NOT_YET_PARSED), f"{line}: no such jdist command"
    if module in NOT_YET_PARSED and module not in PARSED:
        pytest.skip(f"not parsed yet: {NOT_YET_PARSED[module]}")
    try:
        parse(module, args)
    except (ConfigError, SystemExit) as e:
        pytest.fail(f"{line}\n  does not parse: {e!r}", pytrace=False)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_links_between_the_pages_resolve():
    broken = []
    for page in PAGES:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if re.match(r"[a-z]+:", target):
                continue  # http(s) and the like
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            if not file.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and file.suffix == ".md":
                anchors = {slug(h) for h in re.findall(r"^#+ (.*)$", file.read_text(),
                                                       re.MULTILINE)}
                if anchor not in anchors:
                    broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)

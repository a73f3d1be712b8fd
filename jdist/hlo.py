"""Reading compiled HLO: which collectives a step runs and how many bytes they move."""

from __future__ import annotations

import re

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")
_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "bf16": 2, "f16": 2, "s32": 4,
                "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8}
_SHAPE = re.compile(r"\b(" + "|".join(_DTYPE_BYTES) + r")\[([\d,]*)\]")


def _op_pattern(op: str) -> re.Pattern:
    # `%x = (f32[..], f32[..]) all-reduce-start(...)`: match the op name, async form included.
    return re.compile(rf"^\s*\S+ = (.*?) {op}(?:-start)?\(", re.MULTILINE)


def collective_counts(hlo_text: str) -> dict[str, int]:
    """Number of each collective in compiled HLO text (a loop body counts once)."""
    return {op: len(_op_pattern(op).findall(hlo_text)) for op in COLLECTIVES}


def collective_bytes(hlo_text: str) -> dict[str, int]:
    """Result bytes of each collective (summed over tuple elements), per device."""
    out = {}
    for op in COLLECTIVES:
        total = 0
        for result_type in _op_pattern(op).findall(hlo_text):
            for dtype, dims in _SHAPE.findall(result_type):
                n = 1
                for d in filter(None, dims.split(",")):
                    n *= int(d)
                total += n * _DTYPE_BYTES[dtype]
        out[op] = total
    return out


def collective_shapes(hlo_text: str, op: str) -> list[tuple[int, ...]]:
    """Result shapes of every `op` collective (each tuple element separately)."""
    return [tuple(int(d) for d in filter(None, dims.split(",")))
            for result in _op_pattern(op).findall(hlo_text)
            for _, dims in _SHAPE.findall(result)]


def computation(hlo_text: str, name: str) -> str:
    """The text of one named computation (e.g. a while-loop body) of HLO module text."""
    lines = hlo_text.splitlines()
    for i, line in enumerate(lines):
        if re.match(rf"^(?:ENTRY )?%?{re.escape(name)} ", line):
            for j in range(i, len(lines)):
                if lines[j].startswith("}"):
                    return "\n".join(lines[i: j + 1])
    raise KeyError(f"no computation named {name!r}")


def loop_bodies(hlo_text: str) -> list[str]:
    """Texts of the bodies of every while loop (`lax.scan` over layers compiles to one)."""
    names = re.findall(r"body=%?([\w.\-]+)", hlo_text)
    return [computation(hlo_text, name) for name in dict.fromkeys(names)]


def executed_collective_bytes(hlo_text: str) -> dict[str, int]:
    """Like `collective_bytes`, but a while-loop body counts once per iteration (XLA's
    `known_trip_count`; once if unknown), nested loops multiplying: the bytes a run moves."""
    texts = _computations(hlo_text)
    times = dict.fromkeys(texts, 1)
    for name in reversed(list(texts)):  # XLA prints callees first: walk callers first
        for line in texts[name].splitlines():
            loop = re.search(r" while\(.*?body=%?([\w.\-]+)", line)
            if loop and loop.group(1) in times:
                trips = re.search(r'"known_trip_count":\{"n":"(\d+)"', line)
                times[loop.group(1)] = times[name] * (int(trips.group(1)) if trips else 1)
    out = dict.fromkeys(COLLECTIVES, 0)
    for name, text in texts.items():
        for op, n in collective_bytes(text).items():
            out[op] += times[name] * n
    return out


def _computations(hlo_text: str) -> dict[str, str]:
    """{name: text} of every computation in HLO module text, in printed order."""
    out, name, lines = {}, None, []
    for line in hlo_text.splitlines():
        header = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$", line)
        if header and name is None:
            name, lines = header.group(1), [line]
        elif name is not None:
            lines.append(line)
            if line.startswith("}"):
                out[name], name = "\n".join(lines), None
    return out


def partitioned(lowered) -> str:
    """HLO text of a lowered computation right after SPMD partitioning: collectives as the
    program wrote them, before the CPU backend's later passes upcast bf16 ones to f32."""
    import glob
    import tempfile

    with tempfile.TemporaryDirectory() as where:
        lowered.compile(compiler_options={
            "xla_dump_to": where, "xla_dump_hlo_as_text": True,
            "xla_dump_hlo_pass_re": "spmd-partitioning"})
        (path,) = glob.glob(f"{where}/*after_spmd-partitioning*.txt")
        with open(path) as f:
            return f.read()


def collective_dtypes(hlo_text: str) -> dict[str, set[str]]:
    """The element types each collective's results have in HLO text."""
    return {op: {dtype for result in _op_pattern(op).findall(hlo_text)
                 for dtype, _ in _SHAPE.findall(result)} for op in COLLECTIVES}

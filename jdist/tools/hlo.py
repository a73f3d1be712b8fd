"""Reading compiled HLO: which collectives a step runs and how many bytes they move."""

from __future__ import annotations

import dataclasses
import math
import re

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")
_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "bf16": 2, "f16": 2, "s32": 4,
                "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8,
                # float8 (`--fp8`): the formats XLA prints
                "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3fnuz": 1, "f8e5m2fnuz": 1, "f8e4m3": 1,
                "f8e4m3b11fnuz": 1, "f8e3m4": 1, "f8e8m0fnu": 1}
_SHAPE = re.compile(r"\b(" + "|".join(_DTYPE_BYTES) + r")\[([\d,]*)\]")


def _op_pattern(op: str) -> re.Pattern:
    # `%x = (f32[..], f32[..]) all-reduce-start(...)`: match the op name, async form included;
    # a collective can be its computation's ROOT (e.g. a shard_map body's only op).
    return re.compile(rf"^\s*(?:ROOT )?\S+ = (.*?) {op}(?:-start)?\(", re.MULTILINE)


def collective_counts(hlo_text: str) -> dict[str, int]:
    """Number of each collective in compiled HLO text (a loop body counts once)."""
    return {op: len(_op_pattern(op).findall(hlo_text)) for op in COLLECTIVES}


def collective_bytes(hlo_text: str) -> dict[str, int]:
    """Result bytes of each collective (summed over tuple elements), per device."""
    return {op: sum(map(type_bytes, _op_pattern(op).findall(hlo_text))) for op in COLLECTIVES}


def type_bytes(type_text: str) -> int:
    """Bytes of an HLO type such as `(f32[4,8]{1,0}, bf16[2])`: its arrays summed."""
    return sum(math.prod(int(d) for d in filter(None, dims.split(","))) * _DTYPE_BYTES[dtype]
               for dtype, dims in _SHAPE.findall(type_text))


def executed_collectives(hlo_text: str) -> list[tuple[str, str, str, int]]:
    """(op, result type, rest of the line, executions per run) of every collective in HLO
    module text; an async pair counts once, by its `-start` (as `collective_counts` does),
    with the result type of its `-done` (a GPU start's type also holds its operands)."""
    runs = executions(hlo_text)
    out = []
    for name, text in computations(hlo_text).items():
        body = instructions(text)
        done = {start: body[n].type for start, n in dones(body).items()}
        for i in body:
            kind = i.op.removesuffix("-start")
            if kind in COLLECTIVES:
                result = done.get(i.name) or start_result(kind, i.type) \
                    if i.op.endswith("-start") else i.type
                out.append((kind, result, i.rest, runs[name]))
    return out


def start_result(kind: str, type_text: str) -> str:
    """The result part of an async start's type whose done is not beside it (a start
    pipelined across loop iterations): an all-reduce's is its type; the others print
    `((operands), results, ...)` or `(operand, result, contexts)`: the second element."""
    if kind == "all-reduce" or not type_text.startswith("("):
        return type_text
    depth, parts, begin = 0, [], 1
    for i, ch in enumerate(type_text):
        depth += ch in "([{"
        depth -= ch in ")]}"
        if (ch == "," and depth == 1) or depth == 0:
            parts.append(type_text[begin:i])
            begin = i + 1
        if depth == 0:
            break
    return parts[1] if len(parts) > 1 else type_text


def dones(body: list) -> dict[str, int]:
    """{async start's name: position of its `-done`} within one computation's
    instructions (a done's first operand is its start)."""
    return {i.rest.split(")")[0].lstrip("%"): n for n, i in enumerate(body)
            if i.op.endswith("-done")}


@dataclasses.dataclass(frozen=True)
class Instruction:
    """One HLO instruction: its name, result type, opcode, and the rest of its line
    (operands, then attributes)."""

    name: str
    type: str
    op: str
    rest: str


_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (.*?) ([a-z][\w\-]*)\((.*)$")


def instructions(computation_text: str) -> list[Instruction]:
    """The instructions of one computation's text, in printed (for a scheduled module:
    execution) order."""
    return [Instruction(*m.groups()) for m in map(_INSTRUCTION.match,
                                                  computation_text.splitlines()) if m]


_GROUP = re.compile(r"\{([\d,]*)\}")


def device_groups(attributes: str, n_devices: int) -> list[tuple[int, ...]]:
    """The groups of devices one collective communicates within, from its attributes (the
    rest of its HLO line). Devices are positions in the compiled device assignment, not
    device ids. XLA prints three forms: explicit `replica_groups={{0,2},{1,3}}` (`{}`: one
    group of all), iota `replica_groups=[2,4]<=[4,2]T(1,0)`, and mesh axes
    `replica_groups=mesh['axis_0'=2,'axis_1'=4], device_ids=([4,2]T(1,0)) {'axis_1'}`; a
    collective-permute has `source_target_pairs={{0,1},...}` instead (pairs that move)."""
    pairs = re.search(r"source_target_pairs=\{((?:\{[\d,]*\},?)*)\}", attributes)
    if pairs:
        return [(s, t) for s, t in (_ints(p) for p in _GROUP.findall(pairs.group(1))) if s != t]
    explicit = re.search(r"replica_groups=\{((?:\{[\d,]*\},?)*)\}", attributes)
    if explicit:
        groups = [tuple(_ints(g)) for g in _GROUP.findall(explicit.group(1))]
        return groups or [tuple(range(n_devices))]
    iota = re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?",
                     attributes)
    if iota:
        groups, size, dims, perm = iota.groups()
        return [tuple(g) for g in _iota(dims, perm).reshape(int(groups), int(size)).tolist()]
    mesh = re.search(r"replica_groups=mesh\[([^\]]*)\]"
                     r"(?:, device_ids=\(\[([\d,]+)\](?:T\(([\d,]+)\))?\))? \{([^}]*)\}",
                     attributes)
    if mesh:
        return _mesh_axes_groups(*mesh.groups())
    raise ValueError(f"unrecognised device groups in HLO: {attributes[:200]}")


def _ints(text: str) -> list[int]:
    return [int(v) for v in filter(None, text.split(","))]


def _iota(dims: str, perm: str | None):
    """XLA's iota tile assignment `[dims]T(perm)`: arange reshaped to dims, transposed."""
    import numpy as np

    shape = _ints(dims)
    return np.arange(math.prod(shape)).reshape(shape).transpose(_ints(perm) if perm else None)


def _mesh_axes_groups(axes: str, dims: str | None, perm: str | None, grouped: str):
    """Groups of the mesh-axes form: devices that differ only along the grouped axes. A
    sub-axis `'a':(p)k` of an axis of size n is Shardy's: the k-way digit after the p-way
    major one, i.e. coordinate (index // (n / (p k))) % k."""
    import numpy as np

    names, sizes = zip(*((n, int(k)) for n, k in re.findall(r"'([^']+)'=(\d+)", axes)))
    n = math.prod(sizes)
    ids = (_iota(dims, perm) if dims else np.arange(n)).reshape(sizes)
    coords = np.indices(sizes).reshape(len(sizes), n)  # coordinate of each mesh position
    for name, pre, size in re.findall(r"'([^']+)'(?::\((\d+)\)(\d+))?", grouped):
        i = names.index(name)
        size = int(size or sizes[i])
        minor = sizes[i] // (int(pre or 1) * size)
        coords[i] -= (coords[i] // minor % size) * minor  # forget the grouped digit
    key = np.ravel_multi_index(tuple(coords), sizes)
    return [tuple(ids.reshape(n)[key == k].tolist()) for k in np.unique(key)]


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
    texts = computations(hlo_text)
    times = executions(hlo_text)
    out = dict.fromkeys(COLLECTIVES, 0)
    for name, text in texts.items():
        for op, n in collective_bytes(text).items():
            out[op] += times[name] * n
    return out


def executions(hlo_text: str) -> dict[str, int]:
    """{computation name: how often one run of the module executes it}: a while-loop body
    once per iteration (XLA's `known_trip_count`; once if unknown), nested loops
    multiplying; every other computation once."""
    texts = computations(hlo_text)
    times = dict.fromkeys(texts, 1)
    for name in reversed(list(texts)):  # XLA prints callees first: walk callers first
        for line in texts[name].splitlines():
            loop = re.search(r" while\(.*?body=%?([\w.\-]+)", line)
            if loop and loop.group(1) in times:
                trips = re.search(r'"known_trip_count":\{"n":"(\d+)"', line)
                times[loop.group(1)] = times[name] * (int(trips.group(1)) if trips else 1)
    return times


def computations(hlo_text: str) -> dict[str, str]:
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

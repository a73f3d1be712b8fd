"""What the compiler keeps at a step's memory peak: XLA's own account, read from the
live-range report it writes when asked to dump (`xla_dump_to`), on the CPU and the GPU
compiler alike.

The report's "stack trace breakdown for peak usage" attributes every buffer live at the
peak to the JAX operation that made it (`op_name` metadata: `jvp()/while/body/...` is the
forward layer loop, `transpose(jvp())` the backward, `state` the arguments), with sizes.
`python -m jdist.memory --measure --peak-breakdown` prints it: the instrument for holding
`jdist.memory`'s model to a compiler (which terms it misses, which it over-counts).
Its total (`live_peak`) is the most the step's buffers hold at once, arguments included;
the compiled peak (`jdist.memory.peak`) can lie well above it, by bytes no buffer of the
report accounts for (the heap's placement, or what the report does not count; H100
compiler, jax 0.10.2: qwen3-30b-a3b dp=2,ep=2,tp=4 grouped, 12.28 GiB live, 14.98
allocated).
"""

from __future__ import annotations

import glob
import re
import tempfile


def compile_with_breakdown(lowered, options: dict | None = None) -> tuple[object, list[str]]:
    """`lowered` compiled with `options`, and the breakdown lines of its peak (empty where
    the compiler wrote no live-range report)."""
    with tempfile.TemporaryDirectory() as where:
        dump = {"xla_dump_to": where, "xla_dump_hlo_pass_re": "^$"}
        compiled = lowered.compile({**(options or {}), **dump})
        reports = sorted(glob.glob(f"{where}/*jit_step*after_optimizations-live-range.txt"))
        text = open(reports[-1]).read() if reports else ""
    return compiled, breakdown(text)


def breakdown(live_range_text: str, min_share: float = 0.01) -> list[str]:
    """The lines of a live-range report's peak breakdown whose share is at least
    `min_share`, as `share  size  operation` (indentation kept: the tree of computations)."""
    from jdist.memory import gib

    lines = live_range_text.splitlines()
    start = next((i for i, line in enumerate(lines) if "Stack trace breakdown" in line), None)
    if start is None:
        return []
    out = [lines[start].strip()]
    for line in lines[start + 1:]:
        m = re.match(r"^(\s*[│├└─ ]*)(.+?) \(([\d.]+)%, total: ([\d ]+) bytes", line)
        if not m:
            if line.strip():
                continue
            break
        prefix, name, share, total = m.groups()
        if float(share) / 100 >= min_share:
            out.append(f"{float(share):5.1f}% {gib(int(total.replace(' ', '')))} {prefix}{name}")
    return out


def live_peak(lines: list[str]) -> int:
    """The bytes of the breakdown's peak (`breakdown`'s first line): what the compiler's
    buffers hold at once at their peak, before the heap places them (0 without one)."""
    m = re.search(r"peak usage: ([\d ]+) bytes", lines[0]) if lines else None
    return int(m.group(1).replace(" ", "")) if m else 0

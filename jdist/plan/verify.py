"""`python -m jdist.plan ... --verify K`: hold the planner's best K layouts to the GPU compiler.

Each layout is planned by the trainer on the target's compile-only devices
(`jdist.runtime.target`) and its real step compiled for them. The compiled peak (arguments +
outputs - aliases + temporaries) is checked against the budget the planner claimed it fits,
and the step is re-priced with the compiled schedule's exposed share of each collective
(`jdist.tools.gpu_report`) in place of the profile's assumed overlap. The verified ranking drops
what does not fit and orders the rest by the re-priced step time.
"""

from __future__ import annotations

import dataclasses
import time

from jdist.memory import compile_step, peak
from jdist.plan import cost
from jdist.plan.search import _estimate, crossing
from jdist.spmd.mesh import dcn_sizes
from jdist.tools import gpu_report


@dataclasses.dataclass
class Verified:
    planned: cost.Estimate    # as the search priced it (assumed overlap)
    verified: cost.Estimate   # re-priced with the compiled exposure
    compiled_peak: int        # bytes per device, GPU compiler
    report: gpu_report.GpuReport
    fits: bool
    compile_s: float

    @property
    def memory_ratio(self) -> float:
        """Predicted total over the compiled peak."""
        return self.planned.memory.total / self.compiled_peak


def verify(ranked: list[cost.Estimate], k: int, base, hosts: int, profile, budget: float,
           progress=None) -> list[Verified]:
    """Compile the layouts of `ranked` for `base.devices.target` on `hosts` hosts, best first,
    until `k` of them fit `budget` by the GPU compiler (at most 2k compiles); the verified
    ranking: fitting ones by re-priced step time, then the ones that do not fit.
    `progress(n, m, label)` hears before each compile (minutes each for a 70B)."""
    out = []
    candidates = ranked[:2 * k]
    for e in candidates:
        if sum(v.fits for v in out) == k:
            break
        if progress is not None:
            progress(len(out), len(candidates), e.layout.label())
        out.append(compile_layout(e, base, hosts, profile, budget))
    return sorted(out, key=lambda v: (not v.fits, v.verified.step_s))


def compile_layout(e: cost.Estimate, base, hosts: int, profile, budget: float) -> Verified:
    """One planned layout compiled for `base.devices.target` on `hosts` hosts, and re-priced."""
    from jdist.step.from_flags import plan_for

    config = e.layout.to_config(base).replace(hosts=hosts)
    _, plan, _ = plan_for(config)
    start = time.perf_counter()
    compiled = compile_step(plan, base.data.batch_size, base.data.seq_len)
    took = time.perf_counter() - start
    rep = gpu_report.step_report(compiled, plan, base.data.batch_size, base.data.seq_len)
    exposure = {(r.kind, r.axes): r.exposed for r in rep.rows}
    dcn_axes = crossing(dcn_sizes(e.layout.shape, {}, hosts))
    again = _estimate(e.layout, plan, e.memory, profile, dcn_axes, base, exposure)
    top = peak(compiled)
    return Verified(e, again, top, rep, top <= budget, took)


def table(verified: list[Verified]) -> str:
    width = max(len(v.planned.layout.label()) for v in verified)
    lines = [f"{'#':>3} {'layout':{width}} {'predicted GiB':>13} {'compiled GiB':>12} "
             f"{'pred/comp':>9} {'fits':>4} {'exposed':>7} {'assumed s':>9} {'verified s':>10} "
             f"{'MFU':>6}"]
    for i, v in enumerate(verified, 1):
        lines.append(
            f"{i:3d} {v.planned.layout.label():{width}} {v.planned.memory.total / 2**30:13.2f} "
            f"{v.compiled_peak / 2**30:12.2f} {v.memory_ratio:9.3f} "
            f"{'yes' if v.fits else 'NO':>4} {v.report.exposed:7.1%} "
            f"{v.planned.step_s:9.4g} {v.verified.step_s:10.4g} {v.verified.mfu:6.1%}")
    return "\n".join(lines)


def as_json(v: Verified) -> dict:
    return {"layout": v.planned.layout.label(), "flags": v.planned.layout.flags(),
            "predicted_bytes": v.planned.memory.total, "compiled_peak_bytes": v.compiled_peak,
            "fits": v.fits, "assumed_step_s": v.planned.step_s,
            "verified_step_s": v.verified.step_s, "verified_mfu": v.verified.mfu,
            "compile_s": v.compile_s, "gpu": v.report.as_dict()}

"""Pipeline parallelism over the `stage` axis: which schedule a run uses, and its checks.

A static schedule table (`jdist.parallel.pipeline.schedule`) is executed tick by tick inside the
step's shard_map by `jdist.parallel.pipeline.program`; the training side that hands it a chunk
function (embedding on the first chunk, the loss on the last, the per-layer gradient
reductions) is `jdist.step.pipelined`. With V virtual stages (interleaved) the stack is
*stored* permuted (`jdist.parallel.pipeline.layer_order`) so that stage s's shard is chunks
s, s+P, ...
A backward reads what its forward kept under the `--remat` policy (`stashes`): a stage holds
the residuals of its in-flight micro-batches, all M of them under gpipe, about P under 1f1b.
Under `--remat full` it recomputes its chunk from the stashed chunk input instead (`jax.vjp`
per micro-batch, as GPipe does), holding only those inputs. Evaluation runs the forwards of
the same schedule.
"""

from __future__ import annotations

import dataclasses

from jdist.errors import ConfigError, require
from jdist.models.runs import runs
from jdist.parallel.pipeline import schedule as sched
from jdist.spmd import axes as ax
from jdist.spmd.rules import DEFAULT_RULES, Rules, batch_split


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
    schedule: str = sched.ONE_F_ONE_B
    microbatches: int = 0  # 0: one per stage
    virtual: int = 1       # layer chunks per stage (interleaved)

    def table(self, stages: int, forward_only: bool = False,
              stash: bool = False) -> sched.Schedule:
        return sched.build(self.schedule, stages, self.microbatches or stages, self.virtual,
                           forward_only, stash)


def stashes(remat: str) -> bool:
    """Whether a stage's backward reads its forward's residuals rather than recomputing the
    chunk: under every `--remat` policy but full, whose point is to hold the least, and
    offload_selective, whose residuals live in host memory, which the stage program's
    device-memory stash cannot hold (its switch branches would differ in memory kind)."""
    return remat not in ("full", "offload_selective")


def check_pipeline(config: PipelineConfig, model, mesh, batch_size: int,
                   grad_accum: int = 1, rules: Rules = DEFAULT_RULES) -> None:
    """User errors of a pipelined run, one line each, before anything compiles."""
    stages = mesh.shape[ax.STAGE]
    micro = config.microbatches or stages
    model_runs = runs(model)
    if len(model_runs) > 1:  # each run is a chunk of every stage (jdist.step.pipelined)
        require(config.schedule == sched.INTERLEAVED and config.virtual == len(model_runs),
                f"this model's blocks make {len(model_runs)} runs of different kinds "
                f"(--first-dense-layers, --full-attention-every), each a chunk of every "
                f"stage: use --pp-schedule interleaved --pp-virtual-stages {len(model_runs)}")
        for run in model_runs:
            require(run.rows % stages == 0,
                    f"a run of {run.rows} rows of {'expert' if run.moe else 'dense'} blocks "
                    f"(layers {run.first}..{run.first + run.n_layers - 1}) does not split over "
                    f"pp={stages} stages; make each run a multiple of {stages} rows")
    elif model_runs[0].period > 1:  # rows of periods, stored in model order
        require(config.virtual == 1, f"--pp-schedule {config.schedule} stores the layers "
                "permuted by chunk, which a stack of periods (--full-attention-every) is not; "
                "use --pp-schedule 1f1b, gpipe or zb-h1")
    # Equal chunks: of the stack's rows, or (heterogeneous) of each run's, checked above.
    sched.check(config.schedule, stages, micro, config.virtual,
                stages * config.virtual if len(model_runs) > 1 else model_runs[0].rows)
    require(grad_accum == 1, f"--grad-accum {grad_accum} with pp={stages}: the pipeline "
                             "already accumulates over --microbatches; use that instead")
    axes, ways = batch_split(mesh.shape, rules)
    require(batch_size % (ways * micro) == 0,
            f"--batch-size {batch_size} cannot be split into {micro} micro-batches on each of "
            f"{'x'.join(axes) or 'one device'} = {ways} batch shards; use a multiple of "
            f"{ways * micro}")


def pipeline_for(flags, model, mesh, rules: Rules = DEFAULT_RULES) -> PipelineConfig | None:
    """The pipeline a run's flags ask for (`--microbatches`, `--pp-schedule`,
    `--pp-virtual-stages`), checked; None when the mesh has one stage."""
    parallel = flags.parallel
    config = PipelineConfig(parallel.pp_schedule, parallel.microbatches,
                            sched.virtual_stages(parallel.pp_schedule, parallel.pp_virtual_stages))
    if mesh.shape[ax.STAGE] == 1:
        given = pipeline_flags_given(parallel)
        if given:
            raise ConfigError(f"{given[0]} pipelines the model over stages, but --mesh "
                              f"{parallel.mesh} has no pp; add pp=P to --mesh or drop the flag")
        return None
    check_pipeline(config, model, mesh, flags.data.batch_size, flags.memory.grad_accum,
                   rules)
    check_remat(config, flags.memory.remat)
    return config


def pipeline_flags_given(parallel) -> list[str]:
    """The pipeline flags set away from their defaults, as written on the command line (a
    --pp-schedule other than the default is one given; the default one is not told apart)."""
    flags = [("--microbatches", parallel.microbatches, 0),
             ("--pp-schedule", parallel.pp_schedule, PipelineConfig.schedule),
             ("--pp-virtual-stages", parallel.pp_virtual_stages, 1),
             ("--pp-show-schedule", parallel.pp_show_schedule, False)]
    return [flag if isinstance(value, bool) else f"{flag} {value}"
            for flag, value, default in flags if value != default]


def check_remat(config: PipelineConfig, remat: str) -> None:
    """A schedule that splits backwards runs the weight half ticks after the input half,
    from residuals the forward kept: it needs a stash (`stashes`)."""
    require(config.schedule not in sched.SPLIT_BACKWARD or stashes(remat),
            f"--pp-schedule {config.schedule} defers weight gradients, which read the "
            f"forward's residuals, but --remat {remat} keeps none on the device; use --remat "
            "selective or none, or --pp-schedule 1f1b")


def show_schedule(config: PipelineConfig, stages: int) -> str:
    """The executed schedule as a printable stage x tick grid."""
    return config.table(stages).render()

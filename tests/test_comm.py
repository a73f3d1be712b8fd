"""The communication report (jdist.tools.comm): collectives attributed to the mesh axes they run
over, with the bytes the array shapes imply and times from the declared links."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jdist.memory import Breakdown
from jdist.spmd.mesh import Link, Links, links_for
from jdist.tools import comm, hlo

F32 = 4
SHAPE = (8, 16)  # global array; sharded P(first axis, second axis) below


def grid(shape, names):
    # Devices in a scrambled order: HLO groups index positions in the device assignment
    # (mesh.devices.flat), not device ids, and only a non-identity order tells them apart.
    order = np.random.default_rng(0).permutation(8)
    return Mesh(np.asarray(jax.devices())[order].reshape(shape), names)


def rows_of(fn, mesh, in_spec, x=None):
    """The report rows of `fn` run under shard_map on `mesh`: {(kind, axes): Row}."""
    x = jnp.ones(SHAPE, jnp.float32) if x is None else x
    body = jax.shard_map(fn, mesh=mesh, in_specs=in_spec, out_specs=in_spec, check_vma=False)
    text = jax.jit(body).lower(x).compile().as_text()
    return {(r.kind, r.axes): r for r in comm.report(text, mesh).rows}


def shift(axis, n):
    return lambda v: jax.lax.ppermute(v, axis, [(i, (i + 1) % n) for i in range(n)])


MESH_2X4 = ((2, 4), ("x", "y"))
BLOCK_2X4 = (SHAPE[0] // 2, SHAPE[1] // 4)  # (4, 4): what each device holds
CASES_2X4 = [  # (function, kind, axes, result shape per device)
    (lambda v: jax.lax.psum(v, "y"), "all-reduce", ("y",), BLOCK_2X4),
    (lambda v: jax.lax.psum(v, "x"), "all-reduce", ("x",), BLOCK_2X4),
    (lambda v: jax.lax.psum(v, ("x", "y")), "all-reduce", ("x", "y"), BLOCK_2X4),
    (lambda v: jax.lax.all_gather(v, "y", axis=1, tiled=True), "all-gather", ("y",), (4, 16)),
    (lambda v: jax.lax.all_gather(v, ("x", "y"), axis=1, tiled=True), "all-gather",
     ("x", "y"), (4, 32)),
    (lambda v: jax.lax.psum_scatter(v, "y", scatter_dimension=1, tiled=True),
     "reduce-scatter", ("y",), (4, 1)),
    (shift("y", 4), "collective-permute", ("y",), BLOCK_2X4),
    (shift("x", 2), "collective-permute", ("x",), BLOCK_2X4),
    (lambda v: jax.lax.all_to_all(v, "y", 1, 0, tiled=True), "all-to-all", ("y",), (16, 1)),
]


@pytest.mark.parametrize("fn,kind,axes,shape", CASES_2X4)
def test_collectives_are_attributed_to_their_mesh_axes_on_2x4(fn, kind, axes, shape):
    rows = rows_of(fn, grid(*MESH_2X4), P("x", "y"))
    assert list(rows) == [(kind, axes)]
    assert rows[kind, axes].count == 1
    assert rows[kind, axes].bytes == math.prod(shape) * F32


@pytest.mark.parametrize("fn,kind,axes,shape", [
    (lambda v: jax.lax.psum(v, ("a", "c")), "all-reduce", ("a", "c"), (4, 8)),
    (lambda v: jax.lax.all_gather(v, "b", axis=1, tiled=True), "all-gather", ("b",), (4, 16)),
    (lambda v: jax.lax.psum_scatter(v, ("b", "c"), scatter_dimension=1, tiled=True),
     "reduce-scatter", ("b", "c"), (4, 2)),
])
def test_collectives_are_attributed_to_their_mesh_axes_on_2x2x2(fn, kind, axes, shape):
    # Sharded over a (rows) and b (columns); c holds replicas: blocks are (4, 8).
    rows = rows_of(fn, grid((2, 2, 2), ("a", "b", "c")), P("a", "b"))
    assert list(rows) == [(kind, axes)]
    assert rows[kind, axes].bytes == math.prod(shape) * F32


def test_loop_collectives_count_once_per_iteration():
    def body(v):  # 2 outer x 3 inner iterations, one psum each
        inner = lambda _, c: jax.lax.psum(c, "y") * 0.25
        return jax.lax.fori_loop(0, 2, lambda _, c: jax.lax.fori_loop(0, 3, inner, c), v)

    rows = rows_of(body, grid(*MESH_2X4), P("x", "y"))
    assert rows["all-reduce", ("y",)].count == 6
    assert rows["all-reduce", ("y",)].bytes == 6 * math.prod(BLOCK_2X4) * F32


def test_device_group_formats():
    # The three forms XLA prints (jax 0.10.2), worked by hand.
    assert hlo.device_groups("replica_groups={{0,2},{1,3}}, x", 4) == [(0, 2), (1, 3)]
    assert hlo.device_groups("replica_groups={}, x", 4) == [(0, 1, 2, 3)]
    assert hlo.device_groups("replica_groups=[2,4]<=[4,2]T(1,0), x", 8) == \
        [(0, 2, 4, 6), (1, 3, 5, 7)]
    # mesh a=2 x b=4 holding devices [[0,2,4,6],[1,3,5,7]]; group over b's major 2-way digit
    text = "replica_groups=mesh['a'=2,'b'=4], device_ids=([4,2]T(1,0)) {'b':(1)2}, x"
    assert sorted(hlo.device_groups(text, 8)) == [(0, 4), (1, 5), (2, 6), (3, 7)]
    assert hlo.device_groups("source_target_pairs={{0,1},{1,0},{2,2}}", 4) == [(0, 1), (1, 0)]


def test_dry_run_reports_the_compiled_step(monkeypatch, capsys):
    from jdist import memory
    from jdist.config import parse_args
    from jdist.train import fit

    compiled, measured = [], []
    real = memory.compile_step
    monkeypatch.setattr(memory, "compile_step",
                        lambda *a: compiled.append(real(*a)) or compiled[0])
    # The memory measurement (its own gradient compile) is jdist.memory's, tested there.
    monkeypatch.setattr(memory, "measure",
                        lambda *a: measured.append(a[-1]) or Breakdown(1, 1, 1, 1))
    config = parse_args(["--model", "tiny", "--mesh", "dp=2,fsdp=2,tp=2", "--batch-size", "8",
                         "--seq-len", "32", "--dry-run"])
    fit.dry_run(config)
    out = capsys.readouterr().out
    assert len(compiled) == 1 and measured == compiled  # one compile, shared

    _, plan, _ = fit.plan_for(config)
    text = compiled[0].as_text()
    rep = comm.report(text, plan.mesh)
    assert rep.bytes_by_kind() == hlo.executed_collective_bytes(text)
    real_axes = {a for a, n in plan.mesh.shape.items() if n > 1}
    assert {a for r in rep.rows for a in r.axes} <= real_axes
    assert rep.rows and all(r.axes for r in rep.rows)
    gathers = {r.axes: r.count for r in rep.rows if r.kind == "all-gather"}
    assert gathers[("fsdp",)] >= plan.model.n_layers  # each layer's parameters, just in time
    assert comm.comm_table(rep) in out


def test_ring_formulas_by_hand():
    link = Link(gbps=100, latency_us=0)
    # 1 GB all-reduce over 8 devices at 100 GB/s: 2 * 7/8 * 1e9 / 1e11 s
    assert comm.transfer_time("all-reduce", 1e9, 8, link) == pytest.approx(0.0175)
    # gathering 1 GB over 4 and scattering to 0.25 GB shards move the same 0.75 GB
    assert comm.transfer_time("all-gather", 1e9, 4, link) == pytest.approx(0.0075)
    assert comm.transfer_time("reduce-scatter", 0.25e9, 4, link) == pytest.approx(0.0075)
    assert comm.transfer_time("all-to-all", 1e9, 2, link) == pytest.approx(0.005)
    assert comm.transfer_time("collective-permute", 1e9, 2, link) == pytest.approx(0.01)
    # latency only: an all-reduce over 4 is 6 ring steps of 10 us
    assert comm.transfer_time("all-reduce", 0, 4, Link(100, 10)) == pytest.approx(60e-6)
    assert comm.transfer_time("all-reduce", 1e9, 1, link) == 0


def test_preset_links_reach_the_report_and_dcn_axes_use_dcn():
    two_hosts = links_for("gpu-2x8")
    assert two_hosts.dcn_axes == {"data"}
    assert two_hosts.ici == Link(450.0, 2.0) and two_hosts.dcn == Link(50.0, 10.0)
    assert links_for("dp=2,tp=2").dcn_axes == frozenset()  # one host: nothing crosses
    assert two_hosts.over(("data", "fsdp")) == two_hosts.dcn
    assert two_hosts.over(("fsdp",)) == two_hosts.ici

    links = Links(ici=Link(100, 0), dcn=Link(10, 0), dcn_axes=frozenset({"data"}))
    mesh = grid((2, 4), ("data", "fsdp"))
    x = jnp.ones((2, 4 * 2**18), jnp.float32)  # a 2**20-byte block per device
    text = jax.jit(jax.shard_map(lambda v: (jax.lax.psum(v, "data"), jax.lax.psum(v, "fsdp")),
                                 mesh=mesh, in_specs=P("data", "fsdp"), out_specs=P(),
                                 check_vma=False)).lower(x).compile().as_text()
    rows = {r.axes: r for r in comm.report(text, mesh, links).rows}
    # over data (2 devices, DCN 10 GB/s): 2 * 1/2 * 2**20 B / 1e10 B/s
    assert rows[("data",)].seconds == pytest.approx(1.048576e-4)
    # over fsdp (4 devices, ICI 100 GB/s): 2 * 3/4 * 2**20 B / 1e11 B/s
    assert rows[("fsdp",)].seconds == pytest.approx(1.572864e-5)


def test_memory_cli_includes_the_report(monkeypatch, capsys):
    import json

    from jdist import memory
    from jdist.memory import __main__ as cli

    monkeypatch.setattr(memory, "measure", lambda *a: Breakdown(1, 1, 1, 1))  # as above
    assert cli.main(["--model", "tiny", "--mesh", "fsdp=4", "--batch-size", "8", "--seq-len",
                 "32", "--measure", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    kinds = {row["kind"]: row["axes"] for row in out["comm"]["rows"]}
    assert kinds["all-gather"] == ["fsdp"]
    assert out["comm"]["total"]["bytes"] == sum(r["bytes"] for r in out["comm"]["rows"])

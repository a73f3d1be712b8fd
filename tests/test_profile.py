"""`--profile-steps`: parsing the flag, reading collective/compute/idle fractions out of real
jax.profiler traces (the tiny train step on dp=2,fsdp=2,tp=2; a one-device computation), and
the attribution and accounting rules on small synthetic traces."""

import jax
import jax.numpy as jnp
import pytest

from jdist.config.fields import parse_steps
from jdist.errors import ConfigError
from jdist.tools import profile

FRACTIONS = ("comm_fraction", "compute_fraction", "idle_fraction")


def test_parse_steps():
    assert parse_steps("3-5") == (3, 5)
    assert parse_steps("4") == (4, 4)
    assert parse_steps(" 2 - 2 ") == (2, 2)


@pytest.mark.parametrize("text", ["", "a", "5-3", "0-2", "-3", "3-", "1,2", "2-4-6"])
def test_parse_steps_rejects(text):
    with pytest.raises(ConfigError, match="--profile-steps") as e:
        parse_steps(text)
    assert "\n" not in str(e.value)


# ------------------------------------------------------------------ real traces


@pytest.fixture(scope="module")
def tiny_trace(tmp_path_factory):
    """Steps 2-3 of the tiny model's real train step on dp=2,fsdp=2,tp=2, dispatched as the
    loop does (asynchronously; step 4's entry stops the trace): (records, trace path)."""
    from jdist.config import TrainConfig
    from jdist.step.state import init_state
    from jdist.train.loop import compile_step, prepare

    run_dir = tmp_path_factory.mktemp("run")
    config = TrainConfig.of(model="tiny", mesh="dp=2,fsdp=2,tp=2", steps=4, batch_size=8,
                            seq_len=32, eval_every=0, run_dir=str(run_dir))
    setup = prepare(config)
    state = init_state(setup.plan, config.data.seed)
    step_fn = compile_step(setup, state)
    tracer = profile.StepTracer(run_dir / "profile", *parse_steps("2-3"))
    try:
        for i in range(1, config.optim.steps + 1):
            batch = setup.batch(i - 1)
            with tracer.step(i, pending=state):
                state, _ = step_fn(state, batch)
        assert tracer.stopped  # entering step 4 stopped it
        records = tracer.finish(pending=state)
    finally:
        tracer.close()
    return records, profile.find_trace(run_dir / "profile")


def test_tiny_step_fractions(tiny_trace):
    records, path = tiny_trace
    assert [r["step"] for r in records] == [2, 3]
    for r in records:
        assert abs(sum(r[k] for k in FRACTIONS) - 1) <= 0.02
        assert all(0 <= r[k] <= 1 for k in FRACTIONS)
        assert r["comm_fraction"] > 0.01  # fsdp all-gathers, dp/tp all-reduces, ...
        assert r["compute_fraction"] > 0.01
        assert r["devices"] == 8 and r["window_s"] > 0


def test_tiny_trace_readers_and_attributions_agree(tiny_trace):
    """The xplane.pb (jax.profiler.ProfileData) reads as the JSON does; attributing by launch
    order (device ops without run ids, as on GPU) finds the same steps as by run id."""
    records, path = tiny_trace
    xplane = next(path.parent.glob("*.xplane.pb"))
    by_order = profile.load_events(path)
    for e in by_order:
        if "hlo_op" in e["args"]:
            del e["args"]["run_id"]
    for events in (profile.load_events(xplane), by_order):
        for got, want in zip(profile.step_fractions(events), records, strict=True):
            assert got["step"] == want["step"]
            for k in FRACTIONS:
                assert got[k] == pytest.approx(want[k], abs=1e-6)


def test_one_device_has_no_collectives(tmp_path):
    f = jax.jit(lambda x: jnp.tanh(x @ x) @ x)
    x = jax.device_put(jnp.ones((128, 128)), jax.devices()[0])
    x = f(x)
    tracer = profile.StepTracer(tmp_path, 1, 2)
    try:
        for i in (1, 2):
            with tracer.step(i, pending=x):
                x = f(x)
        records = tracer.finish(pending=x)
    finally:
        tracer.close()
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        assert r["comm_fraction"] == 0 and r["devices"] == 1
        assert r["compute_fraction"] > 0
        assert abs(sum(r[k] for k in FRACTIONS) - 1) <= 0.02


def test_tracer_outside_its_steps_is_inert(tmp_path):
    tracer = profile.StepTracer(tmp_path, 5, 6)
    with tracer.step(1):
        pass
    assert not tracer.started and tracer.finish() == []


# ------------------------------------------------------------------ rules, synthetic


@pytest.mark.parametrize("name", [
    "all-reduce.3", "all-gather-start.1", "all-gather-done", "reduce-scatter.2",
    "collective-permute-start.4", "all-to-all", "psum.17", "psum_invariant", "pmax",
    "all_gather.112", "reduce_scatter.17", "ppermute.1", "send.2", "recv-done.1",
    "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevComm*, unsigned long, ncclWork*)"])
def test_collective_names(name):
    assert profile.is_collective(name)


@pytest.mark.parametrize("name", ["ynn_fusion.1", "wrapped_tanh", "axis_index.64", "while.242",
                                  "copy_bitcast_fusion.8", "dot", "gemm_fusion", "sendfoo"])
def test_compute_names(name):
    assert not profile.is_collective(name)


def op(name, start, end, device="d0", thread=1, run_id="r1", module="jit_step"):
    """A CPU-style op event."""
    return {"process": "/host:CPU", "thread": (0, thread), "thread_name": "worker",
            "name": name, "ts": start, "end": end,
            "args": {"hlo_op": name, "hlo_module": module, "run_id": run_id,
                     "device_ordinal": device}}


def step(number, start, end, run_id="r1", module="jit_step"):
    """A step annotation with its launch on the dispatching thread."""
    launch = {"run_id": run_id, "name": module} if run_id else {}
    return [{"process": "/host:CPU", "thread": (0, 0), "thread_name": "python", "name": "train",
             "ts": start, "end": end, "args": {"step_num": str(number)}},
            {"process": "/host:CPU", "thread": (0, 0), "thread_name": "python",
             "name": f"CommonPjRtLoadedExecutable::Execute ({module})", "ts": start + 1,
             "end": end - 1, "args": launch}]


def test_nested_ops_are_not_counted_twice():
    # A while (0-100) runs a matmul (10-40) and an all-reduce (40-90) on its thread; 90-100
    # is loop control. Then the next step starts at 200: 100-200 is idle.
    events = step(1, 0, 5) + step(2, 150, 155, run_id="r2") + [
        op("while.1", 0, 100), op("fusion.1", 10, 40), op("all-reduce.1", 40, 90),
        op("fusion.2", 200, 210, run_id="r2")]
    first = profile.step_fractions(events)[0]
    assert first["comm_fraction"] == pytest.approx(50 / 200)
    assert first["compute_fraction"] == pytest.approx(50 / 200)  # 0-10, 10-40, 90-100
    assert first["idle_fraction"] == pytest.approx(100 / 200)


def test_communication_under_compute_is_hidden():
    # Two devices; on d0 an all-gather (0-60) runs beside a fusion (20-100) on another thread.
    events = step(1, 0, 5) + [
        op("all-gather-start.1", 0, 60, thread=2), op("fusion.1", 20, 100),
        op("fusion.1", 0, 50, device="d1"), op("all-reduce.1", 50, 100, device="d1")]
    (r,) = profile.step_fractions(events)
    assert r["comm_fraction"] == pytest.approx((20 / 100 + 50 / 100) / 2)
    assert r["hidden_comm_fraction"] == pytest.approx((40 / 100 + 0) / 2)
    assert r["idle_fraction"] == pytest.approx(0)


def test_async_dispatch_is_attributed_by_run_id():
    # Both steps were dispatched before either ran: host windows say nothing; run ids do.
    events = step(1, 0, 2) + step(2, 3, 5, run_id="r2") + [
        op("all-reduce.1", 100, 150), op("fusion.1", 150, 200),
        op("fusion.1", 200, 300, run_id="r2")]
    one, two = profile.step_fractions(events)
    assert (one["comm_fraction"], one["compute_fraction"]) == (0.5, 0.5)
    assert (two["comm_fraction"], two["compute_fraction"]) == (0.0, 1.0)


def test_order_attribution_refuses_uneven_executions():
    events = step(1, 0, 2, run_id=None) + step(2, 3, 5, run_id=None) + [
        op("fusion.1", 10, 20, run_id=None), op("fusion.2", 20, 30, run_id=None),
        op("fusion.1", 30, 40, run_id=None)]
    with pytest.raises(profile.TraceError, match="equal executions"):
        profile.step_fractions(events)

"""`--profile-steps A-B`: a `jax.profiler` trace of training steps A..B (TensorBoard/XProf or
Perfetto open `RUN_DIR/profile/plugins/profile/<time>/<host>.trace.json.gz`, a Chrome-format
JSON trace; no separate Perfetto copy is asked for, which would add seconds to every stop),
and from it, per step, the fractions of device time spent in
collectives, in compute, and idle.

Capturing (`StepTracer`). The loop enters `tracer.step(i, pending=state)` around each step's
dispatch. At the first profiled step it waits for `pending` (the previous step's outputs)
and starts the trace, so no earlier step is still running inside it; steps A..B are marked
with `StepTraceAnnotation("train", step_num=i)`; at step B+1 (before its dispatch) or at
`finish(pending)` it waits for step B's outputs and stops. Nothing else synchronises.

Which step a device op belongs to. Steps are dispatched asynchronously: the host annotation
of step i ends long before step i's ops run (and the device may still be running step i-1
while the host dispatches i+1), so host time windows cannot attribute device ops. Instead:
  * by run id: each launch of an executable has a run id, recorded on the host's launch event
    (`CommonPjRtLoadedExecutable::Execute (jit_step)`, inside the step's annotation on the
    dispatching thread) and on every op event it ran on each device (jax 0.10.2, CPU:
    `args.run_id`). Exact, whatever the overlap.
  * else (device ops without run ids, as GPU kernel events may be) by order: a device runs
    executions one after another in launch order, and every execution of one program emits
    the same number of op events; so a device's ops of the step's module, in time order,
    split into one equal chunk per launch (checked: the count must divide evenly, else
    `TraceError`). The waits at start and stop keep partial executions out of the trace.

What is measured, per step and per device (then averaged over the devices):
  window    from the step's first op on the device to the later of its last op and the next
            step's first op there (the last profiled step: the later of its last op and the
            moment the host was about to dispatch step B+1, if the loop got there). So time a
            device waits for the host between steps is the earlier step's idle time.
  compute   the union of the time covered by non-collective ops.
  comm      the union of the time covered by collectives (by HLO op name: all-reduce,
            all-gather, reduce-scatter, collective-permute, all-to-all, their -start/-done,
            send/recv, and the jax primitive names the CPU runtime uses for them: psum,
            all_gather, reduce_scatter, ...; GPU kernels named nccl*) and not by compute:
            the communication the step waited for. A collective's own time includes its wait
            for the slowest peer. What ran under compute is `hidden_comm_fraction` (outside
            the three).
  idle      window - compute - comm. comm + compute + idle = 1.
Op events nest: a `while` op's event spans its body's ops. Such a container contributes only
the time no op of its device ran inside it (loop control), so nothing is counted twice.

Each record: {"step", "comm_fraction", "compute_fraction", "idle_fraction",
"hidden_comm_fraction", "window_s" (mean over devices), "devices"}.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gzip
import json
import re
from collections import defaultdict
from collections.abc import Iterable, Sequence
from pathlib import Path

import jax

STEP_ANNOTATION = "train"                 # XProf's step analysis reads StepTraceAnnotations
NEXT_STEP_MARKER = "jdist.tools.profile.next_step"  # the host is about to dispatch step B+1


class TraceError(RuntimeError):
    """The trace could not be read into per-step fractions (the loop should warn, not stop)."""


# ---------------------------------------------------------------------------- capturing


class StepTracer:
    """A trace of steps `first`..`last` into `directory`; see the module docstring.

        tracer = StepTracer(run_dir / "profile", *parse_steps(config.observe.profile_steps))
        for i in steps:
            with tracer.step(i, pending=state):   # before the step's dispatch
                state, metrics = step_fn(state, batch)
        records = tracer.finish(pending=state)    # or as soon as `tracer.stopped`
        # tracer.close() in a `finally`, so an error never leaves the profiler running.
    """

    def __init__(self, directory: str | Path, first: int, last: int):
        self.directory, self.first, self.last = Path(directory), first, last
        self.started = self.stopped = False
        self._records: list[dict] | None = None

    def step(self, i: int, pending=None) -> contextlib.AbstractContextManager:
        """Enter around step `i`'s dispatch. `pending`: arrays the previous step produced (the
        state it passes to this one); waited for only where the trace starts or stops."""
        if not self.started and self.first <= i <= self.last:
            _wait(pending)  # no earlier step is still running when the trace starts
            self.directory.mkdir(parents=True, exist_ok=True)
            jax.profiler.start_trace(str(self.directory))
            self.started = True
        if self.started and not self.stopped:
            if i <= self.last:
                return jax.profiler.StepTraceAnnotation(STEP_ANNOTATION, step_num=i)
            with jax.profiler.TraceAnnotation(NEXT_STEP_MARKER):
                pass
            self._stop(pending)
        return contextlib.nullcontext()

    def finish(self, pending=None) -> list[dict]:
        """Stop (after waiting for `pending`, the last step's outputs) if still tracing, and
        return each profiled step's record; [] if the trace never started. Raises TraceError
        if the trace cannot be read."""
        if not self.started:
            return []
        if not self.stopped:
            self._stop(pending)
        if self._records is None:
            self._records = step_fractions(load_events(find_trace(self.directory)))
        return self._records

    def close(self) -> None:
        """Stop tracing, if it still is, without reading the trace."""
        if self.started and not self.stopped:
            self.stopped = True
            jax.profiler.stop_trace()

    def _stop(self, pending) -> None:
        _wait(pending)  # the last step's ops all end inside the trace
        self.stopped = True
        jax.profiler.stop_trace()


def _wait(pending) -> None:
    if pending is not None:
        jax.block_until_ready(pending)


# ---------------------------------------------------------------------------- reading


def find_trace(directory: str | Path) -> Path:
    """The newest capture's trace under `directory`: its `<host>.trace.json.gz` (what jax
    writes and copies to perfetto_trace.json.gz), else its `.xplane.pb`."""
    root = Path(directory) / "plugins" / "profile"
    runs = sorted((p for p in root.iterdir() if p.is_dir()) if root.is_dir() else [],
                  key=lambda p: p.stat().st_mtime)
    for run in reversed(runs):
        found = [p for p in run.glob("*.trace.json.gz") if p.name != "perfetto_trace.json.gz"]
        found = found or list(run.glob("perfetto_trace.json.gz")) or list(run.glob("*.xplane.pb"))
        if found:
            return found[0]
    raise TraceError(f"no profiler trace under {directory}/plugins/profile")


def load_events(path: str | Path) -> list[dict]:
    """The trace's complete events as {"process", "thread" (a key), "thread_name", "name",
    "ts", "end" (microseconds), "args"}."""
    path = Path(path)
    if path.name.endswith(".json.gz"):
        with gzip.open(path, "rt") as f:
            return json_events(json.load(f))
    return xplane_events(path)


def json_events(trace: dict) -> list[dict]:
    """Events of a Chrome/Perfetto JSON trace ({"traceEvents": [...]}, ts/dur in us)."""
    raw = trace.get("traceEvents", [])
    processes = {e.get("pid"): e["args"]["name"] for e in raw
                 if e.get("ph") == "M" and e.get("name") == "process_name"}
    threads = {(e.get("pid"), e.get("tid")): e["args"]["name"] for e in raw
               if e.get("ph") == "M" and e.get("name") == "thread_name"}
    return [{"process": processes.get(e.get("pid"), str(e.get("pid"))),
             "thread": (e.get("pid"), e.get("tid")),
             "thread_name": threads.get((e.get("pid"), e.get("tid")), ""),
             "name": e.get("name", ""), "ts": float(e["ts"]),
             "end": float(e["ts"]) + float(e.get("dur", 0.0)), "args": e.get("args") or {}}
            for e in raw if e.get("ph") == "X" and "ts" in e]


def xplane_events(path: Path) -> list[dict]:
    """Events of an `.xplane.pb`, read with `jax.profiler.ProfileData` (for a jax that writes
    no JSON trace; present in jax 0.10.2)."""
    if not hasattr(jax.profiler, "ProfileData"):
        raise TraceError(f"{path}: no JSON trace beside it, and this jax cannot read xplane")
    data = jax.profiler.ProfileData.from_file(str(path))
    return [{"process": plane.name, "thread": (plane.name, n), "thread_name": line.name,
             "name": ev.name, "ts": ev.start_ns / 1e3,
             "end": (ev.start_ns + ev.duration_ns) / 1e3,
             "args": {k: str(v) for k, v in ev.stats}}
            for plane in data.planes for n, line in enumerate(plane.lines)
            for ev in line.events]


# ---------------------------------------------------------------------------- classifying

# HLO collectives by opcode, and by the jax primitive names XLA now gives their instructions
# (`psum.17`, `all_gather.112`, `reduce_scatter.17`, `psum_invariant`, `pmax`: seen in the tiny
# train step's CPU trace, jax 0.10.2); `axis_index` (a partition-id) is not one.
_COLLECTIVE = re.compile(
    r"(?:^|[-.])(?:all-reduce|all-gather|reduce-scatter|collective-permute|all-to-all|"
    r"collective-broadcast|psum|pmax|pmin|ppermute|pbroadcast|send|recv)(?:$|[-.])")


@functools.lru_cache(maxsize=None)  # a step runs each op name many times
def is_collective(op_name: str) -> bool:
    """An HLO op name (`all-reduce.3`, `all-gather-start.1`, or as named after the jax
    primitive, `psum.2`, `all_gather.112`, `reduce_scatter.17`, `psum_invariant`), or a GPU
    kernel name (`ncclDevKernel_AllReduce_...`)."""
    name = op_name.lower().replace("_", "-")
    return bool(_COLLECTIVE.search(name)) or name.startswith("nccl")


@dataclasses.dataclass(frozen=True)
class Op:
    device: str
    thread: tuple
    name: str           # HLO op name (a kernel's name where its HLO op is unknown)
    event: str          # the event's own name (a GPU kernel's name)
    module: str | None  # HLO module (`jit_step`)
    run_id: str | None
    start: float        # microseconds
    end: float


def _communicates(op: Op) -> bool:
    # A NCCL kernel counts whatever HLO op its annotation names (a command buffer's, say).
    return is_collective(op.name) or op.event.lower().startswith("nccl")


_ANNOTATED = re.compile(r"hlo_op=([^,#]+)")
_MODULE = re.compile(r"hlo_module=([^,#]+)")


def device_ops(events: Iterable[dict]) -> list[Op]:
    """The ops executed on devices. CPU (jax 0.10.2): thunk events on the host's worker
    threads with args hlo_op, hlo_module, run_id, device_ordinal. GPU: events on a
    `/device:GPU:N` process's `Stream #..` threads (their HLO op read from args hlo_op or
    the `annotation` stack), or its `XLA Ops` line where there are no stream events."""
    ops, from_lines = [], []
    for e in events:
        args = e["args"]
        on_device = e["process"].startswith("/device:")
        line = e["thread_name"]
        if not (args.get("hlo_op") or (on_device and (line.startswith("Stream")
                                                      or line == "XLA Ops"))):
            continue
        annotation = str(args.get("annotation", ""))
        name = args.get("hlo_op") or _last(_ANNOTATED, annotation) or e["name"]
        module = args.get("hlo_module") or _last(_MODULE, annotation)
        ordinal = args.get("device_ordinal")
        device = f"{e['process']}#{ordinal}" if ordinal is not None else e["process"]
        run_id = args.get("run_id")
        op = Op(device, e["thread"], str(name), e["name"], module and str(module),
                None if run_id is None else str(run_id), e["ts"], e["end"])
        (from_lines if line == "XLA Ops" and not args.get("hlo_op") else ops).append(op)
    streams = {op.device for op in ops}
    ops += [op for op in from_lines if op.device not in streams]
    # Where devices have their own planes (GPU), hlo_op events on host threads are launches.
    if any(op.device.startswith("/device:") for op in ops):
        ops = [op for op in ops if op.device.startswith("/device:")]
    return ops


def _last(pattern: re.Pattern, text: str) -> str | None:
    found = pattern.findall(text)
    return found[-1] if found else None  # the innermost annotation names the op


# ---------------------------------------------------------------------------- attributing


@dataclasses.dataclass
class HostStep:
    number: int
    launches: list[tuple[str | None, str | None]]  # (module, run id) dispatched in it


# Host events launching an executable: `CommonPjRtLoadedExecutable::Execute (jit_step)` (with
# args run_id and name), `...::ExecuteHelperOnSingleDevice` (one device: neither; jax 0.10.2,
# CPU), `PjRtStreamExecutorLoadedExecutable::Execute` and the like; not the CPU runtime's
# `ThunkExecutor::Execute (wait for completion)`, which has a run id too.
_LAUNCH = re.compile(r"Executable::Execute")
_LAUNCHED = re.compile(r"\(([^()]+)\)\s*$")


def host_steps(events: Sequence[dict]) -> list[HostStep]:
    """The profiled steps, from their annotations, each with the executables launched inside
    it on the annotating thread (the outermost launch events there)."""
    by_thread = defaultdict(list)
    for e in events:
        by_thread[e["thread"]].append(e)
    steps = []
    for e in events:
        if e["name"] != STEP_ANNOTATION or "step_num" not in e["args"]:
            continue
        launches, until = [], -1.0
        for inner in sorted(by_thread[e["thread"]], key=lambda x: (x["ts"], -x["end"])):
            if not (e["ts"] <= inner["ts"] <= e["end"]) or inner["ts"] < until:
                continue  # outside the step, or inside a launch already counted
            if "hlo_op" in inner["args"] or not _LAUNCH.search(inner["name"]):
                continue
            run_id = inner["args"].get("run_id")
            named = _LAUNCHED.search(inner["name"])
            module = inner["args"].get("name") or (named[1] if named else None)
            launches.append((module, None if run_id is None else str(run_id)))
            until = inner["end"]
        steps.append(HostStep(int(e["args"]["step_num"]), launches))
    return sorted(steps, key=lambda s: s.number)


def assign_steps(ops: Sequence[Op], steps: Sequence[HostStep]) -> dict[int, list[Op]]:
    """Step number -> its ops: by run id where the launches and the ops of the launched
    modules all carry one, else by launch order."""
    by_run = {run: s.number for s in steps for _, run in s.launches if run is not None}
    modules = {module for s in steps for module, _ in s.launches} - {None}
    if by_run and all(op.run_id is not None for op in ops if op.module in modules
                      or not modules):
        out = defaultdict(list)
        for op in ops:
            if op.run_id in by_run:
                out[by_run[op.run_id]].append(op)
        return dict(out)
    return _assign_by_order(ops, steps)


def _assign_by_order(ops: Sequence[Op], steps: Sequence[HostStep]) -> dict[int, list[Op]]:
    order = [(s.number, module) for s in steps for module, _ in s.launches]
    if not order or any(module is None for _, module in order):
        # Launches that do not name their executable (or none seen): one launch per step,
        # of the module the devices spent the most time in.
        order = [(s.number, _main_module(ops)) for s in steps]
    out = defaultdict(list)
    for module in {m for _, m in order}:
        owners = [number for number, m in order if m == module]
        per_device = defaultdict(list)
        for op in ops:
            if op.module == module:
                per_device[op.device].append(op)
        for device, mine in per_device.items():
            if len(mine) % len(owners):
                raise TraceError(
                    f"{device}: {len(mine)} op events of {module} do not split into "
                    f"{len(owners)} equal executions (dropped events?); cannot tell steps apart")
            mine.sort(key=lambda op: op.start)
            size = len(mine) // len(owners)
            for k, number in enumerate(owners):
                out[number].extend(mine[k * size:(k + 1) * size])
    return dict(out)


def _main_module(ops: Sequence[Op]) -> str | None:
    time = defaultdict(float)
    for op in ops:
        time[op.module] += op.end - op.start
    return max(time, key=time.get) if time else None


# ---------------------------------------------------------------------------- measuring


def merge(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """Sorted disjoint intervals covering the same time."""
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        elif b > a:
            out.append([a, b])
    return [(a, b) for a, b in out]


def total(intervals: Iterable[tuple[float, float]]) -> float:
    return sum(b - a for a, b in intervals)


def subtract(a: Sequence[tuple[float, float]], b: Sequence[tuple[float, float]]):
    """Merged intervals `a` minus merged intervals `b`."""
    out, j = [], 0
    for start, end in a:
        while j < len(b) and b[j][1] <= start:
            j += 1
        k, cur = j, start
        while k < len(b) and b[k][0] < end:
            if b[k][0] > cur:
                out.append((cur, b[k][0]))
            cur = max(cur, b[k][1])
            k += 1
        if cur < end:
            out.append((cur, end))
    return out


def containers(ops: Sequence[Op]) -> set[Op]:
    """Ops whose event contains another op's event on the same thread (a `while` spanning its
    body): they ran other ops rather than computing themselves."""
    found, by_thread = set(), defaultdict(list)
    for op in ops:
        by_thread[op.thread].append(op)
    for mine in by_thread.values():
        open_ops: list[Op] = []
        for op in sorted(mine, key=lambda o: (o.start, -o.end)):
            while open_ops and open_ops[-1].end <= op.start:
                open_ops.pop()
            if open_ops and op.end <= open_ops[-1].end:
                found.add(open_ops[-1])
            open_ops.append(op)
    return found


def device_times(ops: Sequence[Op]) -> dict[str, float]:
    """Exposed collective, compute and hidden collective time (us) of one device's ops."""
    outer = containers(ops)
    leaves = [op for op in ops if op not in outer]
    comm = merge((op.start, op.end) for op in leaves if _communicates(op))
    compute = merge((op.start, op.end) for op in leaves if not _communicates(op))
    busy = merge(comm + compute)
    control = [iv for op in outer for iv in subtract([(op.start, op.end)], busy)]
    compute = merge(compute + control)
    exposed = total(subtract(comm, compute))
    return {"comm": exposed, "compute": total(compute), "hidden": total(comm) - exposed}


def step_fractions(events: Sequence[dict]) -> list[dict]:
    """Each annotated step's record (see the module docstring), in step order."""
    steps = host_steps(events)
    if not steps:
        raise TraceError(f"no {STEP_ANNOTATION!r} step annotations in the trace")
    ops = device_ops(events)
    if not ops:
        raise TraceError("no device op events in the trace")
    assigned = assign_steps(ops, steps)
    marker = max((e["ts"] for e in events if e["name"] == NEXT_STEP_MARKER), default=None)
    numbers = [s.number for s in steps]
    per_step = {n: _by_device(assigned.get(n, [])) for n in numbers}
    records = []
    for k, number in enumerate(numbers):
        if not per_step[number]:
            raise TraceError(f"step {number}: no device ops attributed to it")
        following = per_step[numbers[k + 1]] if k + 1 < len(numbers) else {}
        fractions = []
        for device, mine in per_step[number].items():
            start, end = min(op.start for op in mine), max(op.end for op in mine)
            after = (min(op.start for op in following[device]) if device in following
                     else marker if k + 1 == len(numbers) and marker is not None else end)
            window = max(end, after) - start
            times = device_times(mine)
            fractions.append((window, times))
        records.append(_record(number, fractions))
    return records


def _by_device(ops: Sequence[Op]) -> dict[str, list[Op]]:
    out = defaultdict(list)
    for op in ops:
        out[op.device].append(op)
    return dict(out)


def _record(number: int, fractions: Sequence[tuple[float, dict]]) -> dict:
    n = len(fractions)
    mean = lambda key: sum(t[key] / w for w, t in fractions if w > 0) / n
    comm, compute = mean("comm"), mean("compute")
    return {"step": number, "comm_fraction": comm, "compute_fraction": compute,
            "idle_fraction": max(0.0, 1.0 - comm - compute),
            "hidden_comm_fraction": mean("hidden"),
            "window_s": sum(w for w, _ in fractions) / n / 1e6, "devices": n}

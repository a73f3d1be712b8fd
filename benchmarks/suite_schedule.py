"""The test suite's wall time on N pytest-xdist workers, replayed from measured durations:
does reordering the collection (long tests first) shorten the tail where one worker idles?

    python -m pytest --collect-only -q -o addopts="" > ids.txt
    python benchmarks/suite_schedule.py ids.txt full.log [--first NODEID ...] [--json]

`full.log` holds a `--durations` list (lines `12.3s call tests/x.py::t`; setup and teardown
add to their test). A test the log does not list gets an equal share of what the log says
the run's workers spent beyond the listed tests (`--total-wall` x workers). The replay is
pytest-xdist 3.8's `load` scheduler (xdist/scheduler/load.py): each worker first gets a
chunk of a quarter of its share, in collection order; then a worker whose queue runs below
a quarter of the pending tests per worker is topped up to half of them, unless its last
test took 0.1 s or more and it still holds 2. Unlisted durations are drawn 200 times
(exponential about their mean, under the log's shortest listed time) for the idle tail's
spread. Measured numbers only; nothing runs."""

import argparse
import json
import random
import re


def durations(log_text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for seconds, nodeid in re.findall(r"^([0-9.]+)s (?:call|setup|teardown)\s+(\S+)",
                                      log_text, re.MULTILINE):
        out[nodeid] = out.get(nodeid, 0.0) + float(seconds)
    return out


def replay(times: list[float], workers: int) -> list[float]:
    """Each worker's busy time under xdist's `load` scheduling of tests in this order."""
    pending, queues = list(range(len(times))), [[] for _ in range(workers)]
    chunk = max(len(times) // workers // 4, 2)
    for queue in queues:
        queue += pending[:chunk]
        del pending[:chunk]
    clock = [0.0] * workers
    while any(queues):
        w = min((w for w in range(workers) if queues[w]), key=clock.__getitem__)
        done = queues[w].pop(0)
        clock[w] += times[done]
        low = max(2, len(pending) // workers // 4)
        high = max(2, len(pending) // workers // 2)
        if pending and len(queues[w]) < low and not (times[done] >= 0.1 and
                                                      len(queues[w]) >= 2):
            take = high - len(queues[w])
            queues[w] += pending[:take]
            del pending[:take]
    return clock


def orders(ids: list[str], first: list[str], times: list[float]) -> dict[str, list[int]]:
    rank = {name: r for r, name in enumerate(first)}
    key = lambda i: rank.get(ids[i], rank.get(ids[i].split("[")[0], len(first)))
    plain = list(range(len(ids)))
    return {"collection order": plain, "named tests first": sorted(plain, key=key),
            "longest first (all)": sorted(plain, key=lambda i: -times[i])}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("ids", help="node ids, one a line (pytest --collect-only -q)")
    parser.add_argument("log", help="a pytest --durations log of the whole suite")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--total-wall", type=float, default=1538.0,
                        help="the logged run's wall seconds (default: 2026-12-05's run)")
    parser.add_argument("--set", action="append", default=[], metavar="NODEID=SECONDS",
                        help="a duration the log lacks or got wrong (e.g. Slurm's)")
    parser.add_argument("--first", nargs="*", default=[], help="node ids (or functions) "
                        "to move to the front, in this order")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    ids = [line.strip() for line in open(args.ids) if "::" in line]
    known = durations(open(args.log).read())
    known.update({k: float(v) for k, v in (s.rsplit("=", 1) for s in args.set)})
    unknown = [i for i, name in enumerate(ids) if name not in known]
    rest = max(args.total_wall * args.workers - sum(known.get(n, 0) for n in ids), 0.0)
    mean, cap = rest / max(len(unknown), 1), min(known.values(), default=1.0)
    times = [known.get(name, mean) for name in ids]
    rows = []
    for name, order in orders(ids, args.first, times).items():
        tails = []
        for seed in range(200):
            rng = random.Random(seed)
            for i in unknown:
                times[i] = min(rng.expovariate(1 / mean), cap) if mean else 0.0
            scale = rest / (sum(times[i] for i in unknown) or 1)
            for i in unknown:
                times[i] *= scale
            clock = replay([times[i] for i in order], args.workers)
            tails.append((max(clock), max(clock) - min(clock)))
        walls, idle = sorted(w for w, _ in tails), sorted(t for _, t in tails)
        rows.append({"order": name, "wall_s_median": walls[100], "idle_tail_s_mean":
                     sum(idle) / len(idle), "idle_tail_s_p90": idle[180]})
    if args.json:
        print(json.dumps({"tests": len(ids), "listed": len(ids) - len(unknown),
                          "unlisted_mean_s": mean, "rows": rows}, indent=1))
        return
    print(f"{len(ids)} tests, {len(ids) - len(unknown)} with measured durations, the rest "
          f"{mean:.2f} s on average; {args.workers} workers")
    print(f"{'order':<22} {'wall s':>8} {'idle tail s (mean)':>19} {'(p90)':>7}")
    for r in rows:
        print(f"{r['order']:<22} {r['wall_s_median']:>8.0f} {r['idle_tail_s_mean']:>19.1f} "
              f"{r['idle_tail_s_p90']:>7.1f}")


if __name__ == "__main__":
    main()

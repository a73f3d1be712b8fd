"""The parallelism planner: `python -m jdist.plan` chooses a layout before hardware is rented.

It enumerates the layouts a model can train with on N devices (`layouts.py`), costs each
one without compiling it — memory from `jdist.memory`, FLOPs from `jdist.tools.throughput`,
collectives from `traffic/` priced by `jdist.tools.comm.transfer_time` on an accelerator
profile's links (`profiles.py`, `profiles.toml`), the pipeline bubble from the schedule
simulator (`cost.py`) — and ranks them. `python -m jdist.plan calibrate` measures the
`cpu-sim` profile on this machine (`calibrate.py`).
"""

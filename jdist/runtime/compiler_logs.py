"""Keep XLA's C++ log lines off the commands' terminal.

Compiling for a GPU target, XLA logs warnings and alarms that tell a user nothing to do:
`gpu_collective_performance_model.cc: Runtime estimate for all-to-all-start not
implemented` per collective, and `slow_operation_alarm.cc: Very slow compile?` (an ERROR,
with a banner) once a compile passes two minutes, as a 70B's does. Real failures reach
Python as exceptions, so the commands show XLA's FATAL lines only.

`TF_CPP_MIN_LOG_LEVEL` (0 INFO, 1 WARNING, 2 ERROR, 3 FATAL) is what XLA reads (jax 0.10.2
and 0.12), once, when jax starts its backends: afterwards changing it does nothing, so the
commands call this first. A value the user set is kept: `TF_CPP_MIN_LOG_LEVEL=0` shows
everything again.
"""

from __future__ import annotations

import os

LEVEL = "TF_CPP_MIN_LOG_LEVEL"


def quiet_compiler() -> None:
    os.environ.setdefault(LEVEL, "3")

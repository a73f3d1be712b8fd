"""The collectives of one training step, predicted from the plan (`exact.py`)."""

from jdist.plan.traffic.exact import *  # noqa: F401,F403
from jdist.plan.traffic.exact import collectives, group_size, reported_traffic, step_traffic  # noqa: F401

"""The compiled training step, apart from the host loop (`jdist.train`) and the tools
(`jdist.memory`, `jdist.plan`, `jdist.tools.comm`, `jdist.tools.hlo`, `jdist.tools.profile`).

Read in this order: `state` (the plan: shapes, shardings, optimizer), `build` (the one
jitted step: gradients, then AdamW), `grads` (the replica `shard_map` and its gradient
path; `pipelined` is the same with stages), `forward` (embed -> blocks -> loss, written
once), `context` (what the model is handed: kernels, constraints, the loss from the head).
"""

from jdist.step.build import Batch, make_eval_step, make_train_step
from jdist.step.optim import make_optimizer
from jdist.step.state import Plan, TrainState, init_state, make_plan

__all__ = ["Batch", "Plan", "TrainState", "init_state", "make_eval_step", "make_optimizer",
           "make_plan", "make_train_step"]

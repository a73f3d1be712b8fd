"""Training: state and layout (`make_plan`, `init_state`), the jitted step, the loop and CLI."""

from jdist.train.optim import make_optimizer
from jdist.train.state import Plan, TrainState, init_state, make_plan
from jdist.train.step import make_eval_step, make_train_step

__all__ = ["Plan", "TrainState", "init_state", "make_eval_step", "make_optimizer", "make_plan",
           "make_train_step"]

"""`--tensorboard`: every step's numeric metrics also as TensorBoard scalars, in event files
under RUN_DIR/tensorboard, written by tensorboardX (a maintained writer that needs neither
TensorFlow nor torch). TensorBoard stores scalars as float32. A metric that is a mapping of
numbers (memory by device) becomes one scalar per entry, `name/key`; the health verdict
(`jdist.train.slowdown`) is also written as text."""

from __future__ import annotations

from pathlib import Path

DIR = "tensorboard"


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def scalars(record: dict) -> dict[str, float]:
    """The record's numbers by TensorBoard tag (None, text and lists are not scalars)."""
    out = {}
    for key, value in record.items():
        if key == "step":
            continue
        if _number(value):
            out[key] = value
        elif isinstance(value, dict):
            out.update((f"{key}/{k}", v) for k, v in value.items() if _number(v))
    return out


class TensorBoardLog:
    def __init__(self, run_dir: Path):
        from tensorboardX import SummaryWriter

        # flush_secs: the writer's thread flushes on its own; `close` flushes the rest.
        self.writer = SummaryWriter(logdir=str(Path(run_dir) / DIR), flush_secs=10)

    def write(self, record: dict) -> None:
        step = int(record["step"])
        for tag, value in scalars(record).items():
            self.writer.add_scalar(tag, value, step)
        if "health" in record:
            self.writer.add_text("health", record["health"], step)

    def close(self) -> None:
        self.writer.close()

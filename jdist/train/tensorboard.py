"""`--tensorboard`: every step's numeric metrics also as TensorBoard scalars, in event files
under RUN_DIR/tensorboard, written by tensorboardX (a maintained writer that needs neither
TensorFlow nor torch). TensorBoard stores scalars as float32."""

from __future__ import annotations

from pathlib import Path

DIR = "tensorboard"


class TensorBoardLog:
    def __init__(self, run_dir: Path):
        from tensorboardX import SummaryWriter

        # flush_secs: the writer's thread flushes on its own; `close` flushes the rest.
        self.writer = SummaryWriter(logdir=str(Path(run_dir) / DIR), flush_secs=10)

    def write(self, record: dict) -> None:
        step = int(record["step"])
        for key, value in record.items():
            if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                self.writer.add_scalar(key, value, step)

    def close(self) -> None:
        self.writer.close()

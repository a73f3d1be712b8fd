"""Files written whole or not at all: whoever reads one next (a resume, the launcher, a
planner loading a profile) never finds it cut short by a Ctrl-C, a kill or a full disk."""

import os
from pathlib import Path


def write_atomically(path, text: str, mode: int | None = None) -> Path:
    """`text` at `path`, through a file beside it and a rename (atomic on POSIX). The
    temporary name carries the process id, so processes writing one path never share a
    half-written file; it keeps the umask's permissions unless `mode` is given."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text)
        if mode is not None:
            os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path

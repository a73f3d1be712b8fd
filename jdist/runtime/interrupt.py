"""Ctrl-C before training starts ends the process at once, with status 130.

Left to Python, SIGINT raises KeyboardInterrupt in whatever Python code runs next. In a
run's first seconds that is often one of jax's gc callbacks (`_xla_gc_callback`), whose
exceptions Python only prints ("Exception ignored in"): the run trained to the end and
exited 0. While XLA compiles, the main thread runs no Python for seconds, so the exception
came late, and the interpreter's shutdown beside XLA's still-working threads segfaulted
(after printing "interrupted"). Before the first step there is nothing to save, so here a
thread waits for the signal (the C-level handler writes its number to a wakeup pipe at once,
whatever the main thread is doing) and ends the process with `os._exit`: no exception to
lose, no shutdown to crash. While training has its own handler installed
(`jdist.train.faults.StopSignal`: finish the step, save, exit 75) the thread leaves the
signal to it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Iterator

from jdist.errors import EXIT_INTERRUPTED


def _leave_to_watcher(signum, frame) -> None:
    """The main thread's SIGINT handler while armed: nothing (raising here could land in a
    gc callback and be lost); a handler must be installed for the wakeup pipe to be written."""


def _watch(read_fd: int) -> None:
    while chunk := os.read(read_fd, 64):  # end of file: disarmed
        if signal.SIGINT in chunk and signal.getsignal(signal.SIGINT) is _leave_to_watcher:
            sys.stdout.flush()
            print("jdist: interrupted", file=sys.stderr, flush=True)
            os._exit(EXIT_INTERRUPTED)


@contextlib.contextmanager
def exit_at_once_on_ctrl_c() -> Iterator[None]:
    """Within the block, SIGINT ends the process with EXIT_INTERRUPTED at once, unless
    another SIGINT handler has been installed meanwhile. Outside the main thread (where
    signals cannot be handled) it does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)  # set_wakeup_fd requires it
    previous = signal.signal(signal.SIGINT, _leave_to_watcher)
    previous_fd = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    watcher = threading.Thread(target=_watch, args=(read_fd,), name="jdist-interrupt",
                               daemon=True)
    watcher.start()
    try:
        yield
    finally:
        signal.set_wakeup_fd(previous_fd)
        signal.signal(signal.SIGINT, previous)
        os.close(write_fd)  # the watcher reads end of file and returns
        watcher.join()
        os.close(read_fd)

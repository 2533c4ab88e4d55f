"""The entry point of an engine child process (see `engine.distributed.process`):
`python -m engine.distributed.child FD PARENT_PID`."""

import importlib
import logging
import os
import signal
import sys
import threading
import time
import traceback
from multiprocessing.connection import Connection

from engine.distributed.process import ChildFailed, receive_message, send_message

# How often the child checks that its parent is alive.
_PARENT_CHECK_S = 0.2


def _exit_with_parent(parent_pid: int) -> None:
    """Exits the process at once when the parent is gone (the child is then re-parented)."""
    while os.getppid() == parent_pid:
        time.sleep(_PARENT_CHECK_S)
    os._exit(1)


def main(fd: int, parent_pid: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    threading.Thread(target=_exit_with_parent, args=(parent_pid,), daemon=True, name="parent-watch").start()
    conn = Connection(fd)
    target, payload, cores = receive_message(conn)
    if cores:
        os.sched_setaffinity(0, cores)
    logging.basicConfig(level=logging.WARNING, format=f"%(asctime)s [pid {os.getpid()}] %(levelname)s %(message)s")
    module_name, _, function = target.partition(":")
    try:
        getattr(importlib.import_module(module_name), function)(conn, payload)
    except BaseException:
        try:
            send_message(conn, ChildFailed(traceback.format_exc()))
        except OSError:
            pass
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    os._exit(0)  # no interpreter shutdown: nothing of the engine's is left to tidy


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))

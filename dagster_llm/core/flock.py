"""Exclusive locks among the processes of one machine: an `flock` on a file that also says
who holds it. The kernel drops the lock when its holder's process ends, SIGKILL included,
so a crashed holder never leaves it taken. Used for a machine's GPUs and for the writer
lock of a partition on a local disk."""

import fcntl
from pathlib import Path
from typing import IO


def try_flock(path: Path, holder: str) -> IO[str] | None:
    """The open, locked file with `holder` written in it, or None when another process
    holds it. Closing the file gives the lock back."""
    handle = path.open("a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.close()
        return None
    handle.seek(0)
    handle.truncate()
    handle.write(holder)
    handle.flush()
    return handle


def holder_of(path: Path) -> str:
    """Who holds the lock of `path`, as its holder wrote it ("" if nobody said)."""
    try:
        return path.read_text().strip()
    except OSError:
        return ""

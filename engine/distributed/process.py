"""The engine's child processes: a tensor-parallel rank or a data-parallel replica.

Each is `python -m engine.distributed.child`, not a `multiprocessing` spawn, so that the
parent's `__main__` is never imported again (a script without a `__main__` guard would
otherwise start a second engine). Parent and child talk over a socket pair; messages are
pickled with the standard pickler. A child never outlives its parent: it ignores Ctrl-C
(the parent decides), and a thread in it exits the process as soon as the parent is gone,
SIGKILL included. A child that fails sends its traceback before it exits, and the parent
raises `WorkerError` with it.
"""

import os
import pickle
import signal
import socket
import subprocess
import sys
from multiprocessing.connection import Connection, wait
from typing import Any

# A child that does not exit within this many seconds of being asked is killed.
_STOP_TIMEOUT_S = 10.0


def send_message(conn: Connection, message: Any) -> None:
    """Sends one message over a parent-child connection (raises OSError once it is closed)."""
    conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))


def receive_message(conn: Connection) -> Any:
    """The next message on a parent-child connection (raises EOFError once it is closed)."""
    return pickle.loads(conn.recv_bytes())


class WorkerError(RuntimeError):
    """A process of the engine failed or died; the message names it and says why."""


class ChildProcess:
    """A child process running `target` (a "module:function" taking the connection and
    `payload`) with `threads` CPU threads, pinned to `cores` when given."""

    def __init__(self, name: str, target: str, payload: Any, *, threads: int | None = None,
                 cores: list[int] | None = None) -> None:
        self.name = name
        parent_end, child_end = socket.socketpair()
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)  # the modules the parent sees
        if threads is not None:
            env["OMP_NUM_THREADS"] = str(threads)
        command = [sys.executable, "-m", "engine.distributed.child", str(child_end.fileno()), str(os.getpid())]
        self.process = subprocess.Popen(command, pass_fds=(child_end.fileno(),), env=env)
        child_end.close()
        self.pid = self.process.pid
        self.conn = Connection(parent_end.detach())
        self._exited = os.pidfd_open(self.pid) if hasattr(os, "pidfd_open") else None
        self.error: str | None = None
        self._asked = False  # told to exit
        self.send((target, payload, cores))

    def send(self, message: Any) -> None:
        """Sends a message.

        Raises:
            WorkerError: the child is gone.
        """
        try:
            send_message(self.conn, message)
        except OSError as exc:
            raise WorkerError(self.failure() or f"{self.name} cannot be reached ({exc})") from exc

    def recv(self) -> Any:
        """The child's next message, waiting for it.

        Raises:
            WorkerError: the child reported an error or died.
        """
        waitables = [self.conn] if self._exited is None else [self.conn, self._exited]
        while True:
            ready = wait(waitables, timeout=None if self._exited is not None else 1.0)
            if self.conn in ready:
                try:
                    message = receive_message(self.conn)
                except (EOFError, OSError):
                    raise WorkerError(self.failure() or f"{self.name} closed its connection") from None
                if isinstance(message, ChildFailed):
                    self.error = message.traceback
                    raise WorkerError(f"{self.name} failed:\n{message.traceback}")
                return message
            if ready or self.process.poll() is not None:
                raise WorkerError(self.failure() or f"{self.name} exited")

    def failure(self, timeout: float = 2.0) -> str | None:
        """Why the child failed: its error (waiting up to `timeout` seconds for one that is
        on its way), or how it exited; None while it runs without having failed."""
        if self.error is None and self.conn.poll(timeout if self.process.poll() is None else 0.5):
            try:
                message = receive_message(self.conn)
                if isinstance(message, ChildFailed):
                    self.error = message.traceback
            except (EOFError, OSError, pickle.UnpicklingError):
                try:  # its end is closed: it is exiting, and its status comes in a moment
                    self.process.wait(timeout)
                except subprocess.TimeoutExpired:
                    pass
        if self.error is not None:
            return f"{self.name} failed:\n{self.error}"
        code = self.process.poll()
        if code is None:
            return None
        how = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
        return f"{self.name} (pid {self.pid}) died with {how}"

    def ask_to_exit(self) -> None:
        """Tells a running child to exit (once), without waiting for it."""
        if self.process.poll() is None and not self._asked:
            self._asked = True
            try:
                send_message(self.conn, None)
            except OSError:
                pass

    def stop(self) -> None:
        """Asks the child to exit, kills it if it does not, and reaps it."""
        self.ask_to_exit()
        if self.process.poll() is None:
            try:
                self.process.wait(_STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.conn.close()
        if self._exited is not None:
            os.close(self._exited)
            self._exited = None


class ChildFailed:
    """What a child sends before it exits on an error: the traceback, as text."""

    def __init__(self, traceback: str) -> None:
        self.traceback = traceback


def stop_all(children: list[ChildProcess]) -> None:
    """Stops every child: all are asked first, so they exit together."""
    for child in children:
        child.ask_to_exit()
    for child in children:
        child.stop()

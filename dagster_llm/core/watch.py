"""Stops a step process whose launching process died, so that it writes nothing more."""

import multiprocessing
import os


class LaunchingProcessDied(RuntimeError):
    """The process that started this step is gone; the step stops without writing."""


class ParentWatch:
    """Watches the process that started this one, where multiprocessing started it (the
    step processes of Dagster's multiprocess executor). A SIGKILLed parent cannot stop
    its children, so they check: once it is gone, this process is re-parented."""

    def __init__(self) -> None:
        self.parent = os.getppid() if multiprocessing.parent_process() is not None else None

    def check(self) -> None:
        """Raises `LaunchingProcessDied` once the parent is gone."""
        if self.parent is not None and os.getppid() != self.parent:
            raise LaunchingProcessDied(
                f"the process that launched this step (pid {self.parent}) died; stopping without writing "
                "more. Finished rows are kept in shards: materialize the partition again to resume"
            )

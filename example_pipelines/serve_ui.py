"""`make ui`: `dagster dev` on this repository's workspace, stopped with all it started.

    python -m example_pipelines.serve_ui --port 3000

`dagster dev` shuts its webserver, daemon and code servers down on SIGINT (Ctrl-C in a
terminal reaches them all). Stopped any other way it leaves them running: it gives
SIGTERM the handler of SIGINT, which a shell ignores in its background jobs, and a
parent that is killed takes none of its children with it. This launcher starts it in a
process group of its own with SIGINT's default restored, answers SIGTERM, SIGINT and
SIGHUP with a SIGINT to that whole group (what Ctrl-C does), and once `dagster dev` has
exited, or has not within `GRACE_S`, kills whatever of the group is left: webserver,
daemon, code servers and the workers of runs still in flight.
"""

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GRACE_S = 30.0
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def dev_command(port: int, host: str) -> list[str]:
    """`dagster dev` on workspace.yaml (whose location name matches pyproject.toml's)."""
    dagster = Path(sys.executable).with_name("dagster")
    return [str(dagster), "dev", "-w", str(ROOT / "workspace.yaml"), "--port", str(port), "--host", host]


def serve(command: list[str], grace_s: float = GRACE_S) -> int:
    """Runs `command` in its own process group until it exits or this process is told to stop."""
    dev = subprocess.Popen(command, cwd=ROOT, start_new_session=True,
                           preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))

    def stop(signum: int, frame: object) -> None:
        _signal_group(dev.pid, signal.SIGINT)

    for signum in STOP_SIGNALS:
        signal.signal(signum, stop)
    try:
        code = dev.wait()
    finally:
        _end_group(dev, grace_s)
    return code


def _end_group(dev: subprocess.Popen, grace_s: float) -> None:
    """Waits up to `grace_s` for `dev` and the rest of its group, then kills what remains."""
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and (dev.poll() is None or _group_alive(dev.pid)):
        time.sleep(0.2)
    _signal_group(dev.pid, signal.SIGKILL)
    dev.wait()


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def _signal_group(pgid: int, signum: int) -> None:
    try:
        os.killpg(pgid, signum)
    except ProcessLookupError:
        pass


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Serve the Dagster UI on the example pipelines.")
    parser.add_argument("--port", type=int, default=3000, help="port of the webserver (default 3000)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    args = parser.parse_args(argv)
    return serve(dev_command(args.port, args.host))


if __name__ == "__main__":
    sys.exit(main())

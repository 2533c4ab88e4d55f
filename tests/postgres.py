"""A throwaway PostgreSQL server on loopback for the tests that need a Dagster instance as a
deployment has one (dagster-postgres): Debian's `postgresql` binaries (`make test` installs the
package where it runs as root), a cluster in a temporary folder, trust authentication on
127.0.0.1 only, `fsync` off, stopped when the session ends. As root the server runs as the
package's `postgres` user, since PostgreSQL refuses to run as root."""

import contextlib
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

SERVER_USER = "postgres"
# dagster-postgres talks to the server through psycopg2; SQLAlchemy 2.1 reads a plain postgresql://
# as psycopg 3, with which dagster-postgres 0.29's NOTIFY statements fail.
SCHEME = "postgresql+psycopg2"


def server_binaries() -> Path | None:
    """The folder of `initdb` and `pg_ctl`: on PATH, else the newest of Debian's
    /usr/lib/postgresql/<version>/bin; None where neither is installed."""
    found = shutil.which("initdb")
    if found and shutil.which("pg_ctl"):
        return Path(os.path.realpath(found)).parent
    versions = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"), key=lambda p: int(p.parts[-3]))
    return versions[-1].parent if versions else None


def unavailable_reason() -> str | None:
    """Why no server can be started here, or None."""
    if server_binaries() is None:
        return ("no PostgreSQL server is installed (initdb and pg_ctl): `make test` installs Debian's postgresql "
                "package when it runs as root; else `sudo apt-get install postgresql`")
    if os.geteuid() == 0:
        try:
            pwd.getpwnam(SERVER_USER)
        except KeyError:
            return f"running as root, and there is no {SERVER_USER!r} user to run the server as (PostgreSQL refuses root)"
    return None


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class PostgresServer:
    """One server: `url(database)` names a database on it, `create_database()` makes a fresh one."""

    def __init__(self) -> None:
        self.bin = server_binaries()
        self.folder = Path(tempfile.mkdtemp(prefix="dagster-llm-postgres-"))
        self.data = self.folder / "data"
        self.port = _free_port()
        self.as_user = os.geteuid() == 0
        if self.as_user:
            user = pwd.getpwnam(SERVER_USER)
            os.chown(self.folder, user.pw_uid, user.pw_gid)

    def _run(self, *args: str) -> subprocess.CompletedProcess:
        command = [str(self.bin / args[0]), *args[1:]]
        if self.as_user:
            command = ["runuser", "-u", SERVER_USER, "--", *command]
        return subprocess.run(command, check=True, capture_output=True, text=True, timeout=120)

    def start(self) -> None:
        self._run("initdb", "-D", str(self.data), "-U", "postgres", "--auth=trust", "-E", "UTF8", "--no-sync")
        options = f"-p {self.port} -k {self.folder} -c listen_addresses=127.0.0.1 -c fsync=off -c max_connections=200"
        self._run("pg_ctl", "-D", str(self.data), "-l", str(self.folder / "server.log"), "-o", options, "-w", "start")

    def stop(self) -> None:
        with contextlib.suppress(subprocess.SubprocessError, OSError):
            self._run("pg_ctl", "-D", str(self.data), "-m", "immediate", "-w", "stop")
        shutil.rmtree(self.folder, ignore_errors=True)

    def url(self, database: str = "postgres") -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{database}"

    def create_database(self) -> str:
        """A new, empty database; its URL."""
        import psycopg2

        name = f"dagster_{uuid.uuid4().hex[:12]}"
        connection = psycopg2.connect(self.url())
        connection.autocommit = True
        try:
            with connection.cursor() as cursor:
                cursor.execute(f"CREATE DATABASE {name}")
        finally:
            connection.close()
        return self.url(name)


@contextlib.contextmanager
def running_server() -> Iterator[PostgresServer]:
    server = PostgresServer()
    try:
        server.start()
        yield server
    finally:
        server.stop()


def instance_yaml(postgres_url: str | None, base: str = "") -> str:
    """A dagster.yaml: `base` with the instance's storage on PostgreSQL at `postgres_url` (a
    libpq URL, as `PostgresServer.url` gives; None: `base` as it is, the storage SQLite files
    under DAGSTER_HOME)."""
    if postgres_url is None:
        return base
    url = postgres_url.replace("postgresql://", f"{SCHEME}://", 1)
    return base + f"\nstorage:\n  postgres:\n    postgres_url: \"{url}\"\n"
